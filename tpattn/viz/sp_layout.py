"""Chapter 12's layout figure: where sequence parallelism shards the block and which
collectives join the sequence-sharded and the head-sharded regions, in this book's, Megatron-LM's
and the Ultra-Scale Playbook's names."""
from __future__ import annotations

import matplotlib.patches as mpatches

from .style import DENSE_COLOR, arrow, box, new_figure

__all__ = ["sp_layout_figure", "SP_COLLECTIVE_NAMES"]

#: Per collective: this book's Function, Megatron-LM's function, the paper's and the Playbook's
#: letters, the forward and the backward.
SP_COLLECTIVE_NAMES = {
    "gather": ("GatherSequence", "gather_from_sequence_parallel_region", "g", "g",
               "all-gather", "reduce-scatter"),
    "scatter": ("ScatterSequence", "reduce_scatter_to_sequence_parallel_region", "ḡ", "g*",
                "reduce-scatter", "all-gather"),
}

_SP_FACE, _TP_FACE = "#e8f1fa", "#fdf0e2"
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
    """The sequence-parallel block, one rank's view: the norm on its own ``S/W`` tokens, an
    all-gather into the column-parallel Q/K/V, the attention on its heads, the row-parallel
    ``W_o``, a reduce-scatter back to its tokens; each collective labelled with this book's,
    Megatron-LM's, the paper's and the Playbook's names."""
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
    ax.set_xlim(-0.6, 7.6)
    ax.set_ylim(-1.35, 1.9)
    ax.axis("off")
    return fig
