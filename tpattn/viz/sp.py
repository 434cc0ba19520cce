"""Figures for chapter 12, sequence parallelism, from plain numbers (simulated or real ranks)."""
from __future__ import annotations

from typing import Mapping, Sequence

from .style import DENSE_COLOR, FAIL_COLOR, new_figure, rank_color

__all__ = ["norm_grad_by_rank_figure", "sp_ledger_figure"]

_COLLECTIVE_COLORS = {"all_reduce": "#7f7f7f", "all_gather": "#1f77b4", "reduce_scatter": "#ff7f0e"}


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
    ax.set_xlabel("hidden channel")
    ax.set_ylabel("∂L/∂norm")
    ax.set_title(title)
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
