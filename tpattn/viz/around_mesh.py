"""Figures of "Around the block": a TP x DP mesh's groups, and what SP's all-gather brings home."""
from __future__ import annotations

import matplotlib.patches as mpatches

from tpattn.config import Config
from tpattn.parallel.collectives import SimulatedRanks
from .style import DENSE_COLOR, FAIL_COLOR, PASS_COLOR, bare_axes, new_figure, rank_color

__all__ = ["mesh_groups_figure", "mesh_panels", "sp_gather_figure", "gathered_sources"]

#: ``mesh_groups_figure``'s panels: (title, the correct group, the bug's group, the mode).
MESH_PANELS = (
    ("logged loss: all-reduce", "dp", "world", "loss_reduced_over_world"),
    ("logged loss: full_tensor()", "dp", "tp", "loss_full_tensor_tp_only"),
    ("DP gradient all-reduce", "dp", "self", "dp_grad_group_of_one"),
)


def mesh_panels(cfg: Config) -> list[dict]:
    """Per panel ``title``, ``mode`` and the groups (global ranks) used ``right`` and ``wrong``."""
    comm = SimulatedRanks(cfg)
    def groups(name):  # "tp": full_tensor() of a Replicate DTensor reduces nothing
        return [[r] for r in range(cfg.ranks)] if name in ("self", "tp") else comm.groups(name)
    return [{"title": title, "mode": mode, "right": groups(right), "wrong": groups(wrong)}
            for title, right, wrong, mode in MESH_PANELS]


def _grid(ax, cfg: Config, groups: list[list[int]], color: str, title: str) -> None:
    w, d = cfg.world_size, cfg.data_parallel
    for r in range(cfg.ranks):
        x, y = r % w, d - 1 - r // w
        ax.add_patch(mpatches.FancyBboxPatch((x - 0.32, y - 0.28), 0.64, 0.56,
                                             boxstyle="round,pad=0.02",
                                             facecolor=rank_color(r % w), alpha=0.35,
                                             edgecolor=DENSE_COLOR))
        ax.text(x, y, f"rank {r}\ndp{r // w} tp{r % w}", ha="center", va="center", fontsize=7)
    for members in groups:
        xs = [m % w for m in members]
        ys = [d - 1 - m // w for m in members]
        ax.add_patch(mpatches.FancyBboxPatch(
            (min(xs) - 0.42, min(ys) - 0.38), max(xs) - min(xs) + 0.84,
            max(ys) - min(ys) + 0.76, boxstyle="round,pad=0.02", fill=False,
            edgecolor=color, linewidth=1.6, linestyle="-" if len(members) > 1 else ":"))
    bare_axes(ax, (-0.6, w - 0.4), (-0.6, d - 0.4), equal=True)
    ax.set_title(title, fontsize=8)


def mesh_groups_figure(cfg: Config | None = None):
    """A column per ``mesh_panels`` panel: the ranks framed by the right groups, then the bug's."""
    cfg = cfg or Config(data_parallel=2)
    panels = mesh_panels(cfg)
    fig, axes = new_figure(len(panels), 2, figsize=(7.0, 3.8))
    for j, panel in enumerate(panels):
        _grid(axes[0][j], cfg, panel["right"], PASS_COLOR, panel["title"] + "\n(correct)")
        _grid(axes[1][j], cfg, panel["wrong"], FAIL_COLOR, panel["mode"])
    fig.suptitle(f"TP {cfg.world_size} x DP {cfg.data_parallel}: global rank = "
                 f"dp * {cfg.world_size} + tp", fontsize=9)
    return fig


def gathered_sources(cfg: Config, group: str = "tp") -> list[list[tuple[int, int]]]:
    """Per rank, the ``(dp replica, token chunk)`` of each chunk its sequence all-gather over
    ``group`` (``"tp"`` or ``"dp"``) returns."""
    comm = SimulatedRanks(cfg)
    out = [None] * cfg.ranks
    for members in comm.groups(group):
        got = [(m // cfg.world_size, m % cfg.world_size) for m in members]
        for m in members:
            out[m] = got
    return out


def sp_gather_figure(cfg: Config | None = None):
    """Each rank's ``gathered_sources`` as chunks colored by replica, over the TP and DP groups."""
    cfg = cfg or Config(data_parallel=2, sequence_parallel=True, seq=4)
    fig, axes = new_figure(2, 1, figsize=(6.3, 0.5 + 0.45 * cfg.ranks))
    for ax, group, title in ((axes[0], "tp", "over the TP group (correct)"),
                             (axes[1], "dp", "over the DP group (sp_gather_wrong_group)")):
        for r, chunks in enumerate(gathered_sources(cfg, group)):
            y = cfg.ranks - 1 - r
            for i, (rep, chunk) in enumerate(chunks):
                own = rep == r // cfg.world_size
                ax.add_patch(mpatches.Rectangle((i, y - 0.4), 0.95, 0.8,
                                                facecolor=rank_color(4 + rep), alpha=0.55,
                                                edgecolor=DENSE_COLOR if own else FAIL_COLOR,
                                                linewidth=1.0 if own else 2.0))
                ax.text(i + 0.47, y, f"r{rep} t{chunk}", ha="center", va="center", fontsize=7)
            ax.text(-0.15, y, f"rank {r} (dp{r // cfg.world_size})", ha="right",
                    va="center", fontsize=7)
        bare_axes(ax, (-1.9, cfg.world_size), (-0.6, cfg.ranks - 0.4))
        ax.set_title(title, fontsize=9)
    fig.suptitle("chunks each rank gathers: r = replica, t = token chunk (red: another "
                 "replica's)", fontsize=8)
    return fig
