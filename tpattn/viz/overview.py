"""Figures for the landing page and chapter 1: the map of the block, and the scale of 1e-6."""
from __future__ import annotations

import functools
import math

import torch

from tpattn.check.core import MISSING_INPUT_GRAD_REDUCE, MISSING_OUTPUT_REDUCE, MODES, PARAM_SEED_OFFSET, \
    TOLERANCE, make_inputs
from tpattn.config import Config
from tpattn.block.dense import dense_forward
from tpattn.block.layers import attention, repeat_kv, rms_norm
from tpattn.block.params import init_params, rank_head_slices
from tpattn.parallel.tp import copy_to_ranks, reduce_output_partials
from .style import DENSE_COLOR, FAIL_COLOR, PASS_COLOR, arrow, bare_axes, box, new_figure, rank_color
from tpattn.bugs.modes import run

__all__ = ["rank_heads", "block_map_figure", "float32_rounding_errors", "float32_rounding_figure"]

_F_G_COLOR = "#6a3d9a"  # the two collectives
_boxed = functools.partial(box, pad=0.3)


def rank_heads(cfg: Config, rank: int) -> tuple[range, range]:
    """Query heads and KV heads that TP rank ``rank`` owns."""
    q_rows, kv_rows = rank_head_slices(cfg, rank)
    d = cfg.head_dim
    return range(q_rows.start // d, q_rows.stop // d), range(kv_rows.start // d, kv_rows.stop // d)


def _heads_text(heads: range) -> str:
    return str(heads.start) if len(heads) == 1 else f"{heads.start}–{heads.stop - 1}"


def _rank_lane(ax, cfg: Config, rank: int, y: float, mid: float) -> None:
    """Rank ``rank``'s lane of the block map at height ``y``."""
    color = rank_color(rank)
    q_heads, kv_heads = rank_heads(cfg, rank)
    arrow(ax, (34.5, mid), (38.7, y), color=color)
    ax.text(38.7, y + 4.3, f"rank {rank}", color=color, fontsize=8.5, weight="bold",
            ha="left", va="bottom")
    _boxed(ax, 44, y, 10, 7, f"wq, wk, wv rows\nq heads {_heads_text(q_heads)}\n"
           f"kv head{'s' if len(kv_heads) > 1 else ''} {_heads_text(kv_heads)}", color, size=8)
    arrow(ax, (49.4, y), (52.3, y), color=color)
    _boxed(ax, 58.5, y, 10.5, 7, f"RoPE, {repeat_kv.__name__},\ncausal {attention.__name__}",
           color, size=8)
    arrow(ax, (64.1, y), (67.0, y), color=color)
    _boxed(ax, 72.0, y, 9.0, 7, f"wo columns\n→ partial {rank}\n[{cfg.seq}, {cfg.batch}, "
           f"{cfg.hidden}]", color, size=8)
    arrow(ax, (76.9, y), (80.0, mid), color=color)


def _g_and_residual(ax, mid: float, top: float) -> None:
    """The block map's right end: g, ``+ x`` (the residual along ``top``), ``y``."""
    g_name = reduce_output_partials.__name__.replace("output_", "output_\n")
    _boxed(ax, 85.5, mid, 10.5, 11, f"g\n{g_name}\nfwd: all-reduce (Σ)\nbwd: identity",
           _F_G_COLOR, face="#f3eef8", size=8)
    _boxed(ax, 94.6, mid, 2.4, 3, "+", DENSE_COLOR, size=11, weight="bold")
    arrow(ax, (91.1, mid), (93.2, mid))
    ax.text(99.6, mid, "y", ha="center", va="center", fontsize=11, weight="bold")
    arrow(ax, (96.1, mid), (98.6, mid))
    ax.plot([4, 4, 94.6], [mid + 3.4, top, top], color=DENSE_COLOR, lw=1.1)
    arrow(ax, (94.6, top), (94.6, mid + 1.9))
    ax.text(50, top + 0.8, "residual: + x  (backward: dy reaches dX directly; dX itself is never all-reduced)",
            ha="center", va="bottom", fontsize=8, color=DENSE_COLOR)


def block_map_figure(cfg: Config | None = None):
    """The block split across ``cfg.world_size`` ranks: ``x`` → RMSNorm → f → a lane per rank
    → g → ``+ x``, labelled with the package's names."""
    cfg = Config() if cfg is None else cfg
    world = cfg.world_size
    lane_gap = 13.0
    lane_y = [-lane_gap * r for r in range(world)]
    mid = (lane_y[0] + lane_y[-1]) / 2
    top = lane_y[0] + 9.0  # the residual path
    bottom = lane_y[-1] - 6.5  # the notes
    y_range = (top + 3.0) - (bottom - 5.5)
    fig, ax = new_figure(figsize=(10.0, round(y_range * 0.105, 1)))
    bare_axes(ax, (-1, 101), (bottom - 5.5, top + 3.0))
    s, b, hidden = cfg.seq, cfg.batch, cfg.hidden
    _boxed(ax, 4, mid, 6.5, 6, f"x\n[{s}, {b}, {hidden}]", DENSE_COLOR, size=8.5)
    _boxed(ax, 16, mid, 9, 6, f"{rms_norm.__name__}\n(norm: every\nrank the same)", DENSE_COLOR, size=8)
    arrow(ax, (7.8, mid), (11.2, mid))
    # f: one tensor in, one copy per rank out
    _boxed(ax, 29, mid, 10.5, 9,
           f"f\n{copy_to_ranks.__name__}\nfwd: identity\nbwd: all-reduce dn", _F_G_COLOR, face="#f3eef8", size=8)
    arrow(ax, (20.8, mid), (23.5, mid))
    ax.text(22.15, mid + 0.8, "n", ha="center", va="bottom", fontsize=8.5, style="italic")
    for rank, y in enumerate(lane_y):
        _rank_lane(ax, cfg, rank, y, mid)
    _g_and_residual(ax, mid, top)
    ax.text(29, bottom, "without f's all-reduce: forward and loss\nidentical, gradients wrong (ch. 9)",
            ha="center", va="top", fontsize=8, color=FAIL_COLOR)
    ax.text(85.5, bottom, "without g: the forward\nis already wrong (ch. 8)",
            ha="center", va="top", fontsize=8, color=FAIL_COLOR)
    ax.text(58.5, bottom, f"each rank holds complete query/KV groups\n({cfg.query_heads} query heads, "
            f"{cfg.kv_heads} KV heads, {world} ranks)", ha="center", va="top", fontsize=8,
            color=DENSE_COLOR)
    return fig


def float32_rounding_errors(seed: int = 11, cfg: Config | None = None) -> torch.Tensor:
    """``|y_float32 − y_float64|`` ``[S, B, hidden]`` of the dense block on the same inputs."""
    cfg = Config() if cfg is None else cfg
    if cfg.dtype != "float32":
        raise ValueError(f"cfg.dtype must be 'float32' to measure its rounding (got {cfg.dtype!r})")
    cfg64 = Config(**{**cfg.as_dict(), "dtype": "float64"})
    outputs = []
    for c in (cfg, cfg64):
        x, _ = make_inputs(c, seed)
        outputs.append(dense_forward(x, init_params(c, seed + PARAM_SEED_OFFSET), c))
    return (outputs[0].double() - outputs[1]).abs().detach()


def float32_rounding_figure(seed: int = 11, cfg: Config | None = None):
    """A histogram of ``float32_rounding_errors`` (log x), the tolerance, and a line per mode
    at its largest measure."""
    errors = float32_rounding_errors(seed, cfg).flatten()
    floor, top = 1e-12, 10.0
    fig, ax = new_figure(figsize=(7.5, 3.3))
    edges = torch.logspace(-12, 1, 53, dtype=torch.float64)
    shown = errors.clamp(min=floor * 1.01)
    counts, _ = torch.histogram(shown, bins=edges)
    ax.stairs(counts.numpy(), edges.numpy(), fill=True, color="#bbbbbb",
              label=f"|float32 − float64|, {errors.numel()} output elements")
    ymax = float(counts.max()) * 1.35
    ax.set(xscale="log", xlim=(floor / 2, top), ylim=(0, ymax))
    ax.axvline(TOLERANCE, color="black", ls="--", lw=1.2)
    ax.text(TOLERANCE * 1.3, ymax * 0.96, "threshold 1e-6", va="top", fontsize=8.5)
    for i, mode in enumerate(MODES):
        result = run(seed, mode, cfg)
        worst = max(result[m] for m in result if m.endswith("_diff"))
        color = PASS_COLOR if result["passed"] else FAIL_COLOR
        x = max(worst, floor)
        ax.axvline(x, color=color, lw=2)
        label = {MISSING_OUTPUT_REDUCE: "missing g", MISSING_INPUT_GRAD_REDUCE: "missing f"}.get(mode, mode)
        ax.text(x / 1.3, ymax * (0.80 - 0.14 * i), label, color=color, ha="right", fontsize=8.5)
    ticks = [1e-12, 1e-10, 1e-8, 1e-6, 1e-4, 1e-2, 1]
    ax.set_xticks(ticks, ["0"] + [f"1e{round(math.log10(t))}" for t in ticks[1:]])
    ax.set(xlabel="absolute difference", ylabel="elements",
           title=f"seed {seed}: float32 rounding sits below 1e-6, the bugs far above it")
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    return fig
