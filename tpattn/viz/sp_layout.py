"""Figures of chapter 12, sequence parallelism: the block's layout, per-rank gradients, bytes sent."""
from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.patches as mpatches

from .style import DENSE_COLOR, FAIL_COLOR, arrow, bare_axes, box, new_figure, rank_color

__all__ = ["sp_layout_figure", "SP_COLLECTIVE_NAMES", "norm_grad_by_rank_figure",
           "sp_ledger_figure"]

#: Per collective: this book's Function, Megatron-LM's function, the paper's and the Playbook's
#: letters, the forward and the backward.
SP_COLLECTIVE_NAMES = {
    "gather": ("GatherSequence", "gather_from_sequence_parallel_region", "g", "g",
               "all-gather", "reduce-scatter"),
    "scatter": ("ScatterSequence", "reduce_scatter_to_sequence_parallel_region", "ḡ", "g*",
                "reduce-scatter", "all-gather"),
}

_SP_FACE, _TP_FACE = "#e8f1fa", "#fdf0e2"
_COLLECTIVE_COLORS = {"all_reduce": "#7f7f7f", "all_gather": "#1f77b4", "reduce_scatter": "#ff7f0e"}
# (x, label): the block's steps left to right; the collectives sit at x = 2 and x = 6
_STEPS = ((0, "$x_r$\nS/W tokens"), (1, "RMSNorm\nown tokens"), (3, "Q, K, V\ncolumn-\nparallel"),
          (4, "attention\nH/W heads,\nall S tokens"), (5, "$W_o$\nrow-\nparallel"),
          (7, "$x_r$ + out\nS/W tokens"))


def _regions(ax) -> None:
    """The shaded bands: sequence-sharded outside, head-sharded (all S tokens) inside."""
    for left, right, face, text in ((-0.55, 2, _SP_FACE, "sequence-parallel:\nS/W tokens per rank"),
                                    (2, 6, _TP_FACE, "tensor-parallel: all S tokens,\nH/W heads "
                                                     "per rank"),
                                    (6, 7.55, _SP_FACE, "sequence-parallel:\nS/W tokens per rank")):
        ax.axvspan(left, right, ymin=0.32, ymax=1, color=face, zorder=0)
        ax.text((left + right) / 2, 1.55, text, ha="center", va="center", fontsize=8.5,
                style="italic")


def _collective(ax, x: float, key: str) -> None:
    """One collective: its letters in a circle, its names and both passes underneath."""
    ours, megatron, paper, playbook, forward, backward = SP_COLLECTIVE_NAMES[key]
    ax.add_patch(mpatches.Circle((x, 0.5), 0.3, facecolor="white", edgecolor=DENSE_COLOR, lw=1.4, zorder=3))
    ax.text(x, 0.5, paper, ha="center", va="center", fontsize=13, weight="bold", zorder=4)
    ax.text(x, 0.05, f"fwd: {forward}\nbwd: {backward}", ha="center", va="top", fontsize=8.5)
    ax.text(x, -0.55, f"{ours}\nMegatron: {megatron}\npaper: {paper}   Playbook: {playbook}",
            ha="center", va="top", fontsize=7.5, family="monospace")


def sp_layout_figure():
    """One rank's sequence-parallel block: the norm on its ``S/W`` tokens, an all-gather, the
    head-sharded attention, a reduce-scatter back to its tokens; each collective in four names."""
    fig, ax = new_figure(figsize=(8.6, 3.6))
    _regions(ax)
    for x, text in _STEPS:
        box(ax, x, 0.5, 0.78, 0.8, text, size=8)
    xs = [x for x, _ in _STEPS]
    for a, b in zip(xs, xs[1:]):
        if b - a == 1:
            arrow(ax, (a + 0.42, 0.5), (b - 0.42, 0.5))
        else:  # into the collective at a + 1, and out of it
            arrow(ax, (a + 0.42, 0.5), (a + 0.68, 0.5))
            arrow(ax, (a + 1.32, 0.5), (b - 0.42, 0.5))
    _collective(ax, 2, "gather")
    _collective(ax, 6, "scatter")
    ax.set_title("sequence parallelism, one rank (g, ḡ: the SP paper's letters, not TP's g)",
                 fontsize=9.5)
    bare_axes(ax, (-0.6, 7.6), (-1.35, 1.9))
    return fig


def norm_grad_by_rank_figure(by_rank: Sequence[Sequence[float]], truth: Sequence[float],
                             title: str = "norm gradient without its all-reduce"):
    """Each rank's ``norm`` gradient (``W`` lists of ``hidden``), their sum and the truth."""
    if not by_rank or any(len(g) != len(truth) for g in by_rank):
        raise ValueError(f"by_rank must hold one gradient of length {len(truth)} per rank "
                         f"(got {[len(g) for g in by_rank]})")
    channels = range(len(truth))
    fig, ax = new_figure(figsize=(7.5, 3.4))
    ax.plot(channels, truth, color=DENSE_COLOR, lw=4, alpha=0.35, label="dense (the truth)")
    for r, grad in enumerate(by_rank):
        ax.plot(channels, grad, marker="o", ms=3.5, lw=1, color=rank_color(r), label=f"rank {r}")
    total = [sum(g[c] for g in by_rank) for c in channels]
    ax.plot(channels, total, "x", color=FAIL_COLOR, ms=6, label="sum over ranks")
    ax.axhline(0, color=DENSE_COLOR, lw=0.5)
    ax.set(xlabel="hidden channel", ylabel="∂L/∂norm", title=title)
    ax.legend(fontsize=8, ncols=min(len(by_rank) + 2, 6), loc="upper center",
              bbox_to_anchor=(0.5, -0.22), frameon=False)
    return fig


def sp_ledger_figure(rows: Sequence[Mapping]):
    """Bytes a rank sends per step by variant, stacked by collective (``communication_ledger``)."""
    variants = list(dict.fromkeys(row["variant"] for row in rows))
    if not variants:
        raise ValueError("rows must hold at least one collective (communication_ledger)")
    fig, ax = new_figure(figsize=(7.5, 3.0))
    seen = set()
    for y, variant in enumerate(variants):
        left = 0.0
        for row in (r for r in rows if r["variant"] == variant):
            label = row["collective"].replace("_", "-")
            ax.barh(y, row["bytes_per_rank"], left=left, height=0.6, edgecolor="white",
                    color=_COLLECTIVE_COLORS[row["collective"]],
                    label=None if label in seen else label)
            seen.add(label)
            left += row["bytes_per_rank"]
        ax.text(left, y, f"  {left:,.0f} B", va="center", fontsize=9)
    ax.set_yticks(range(len(variants)), variants)
    ax.invert_yaxis()
    ax.set_xlabel("bytes sent per rank per step (ring algorithm)")
    ax.set_xlim(0, ax.get_xlim()[1] * 1.18)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncols=3, frameon=False)
    return fig
