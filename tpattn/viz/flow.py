"""Gradient-flow diagrams: the block's two gradient paths (chapter 5), the sharded backward (7)."""
from __future__ import annotations

from tpattn.config import Config
from .style import DENSE_COLOR, FAIL_COLOR, arrow, bare_axes, box, new_figure, rank_color

__all__ = ["gradient_paths_figure", "backward_flow_figure"]

GRAD_COLOR = "#7b3294"


def _arrow(ax, start, end, color=GRAD_COLOR, lw=1.5, ls="-", text=None, at=0.5, dy=0.12,
           size=8.5, rad=0.0):
    arrow(ax, start, end, color, lw, ls, rad, shrink=2)
    if text:
        x = start[0] + at * (end[0] - start[0])
        y = start[1] + at * (end[1] - start[1]) + dy
        ax.text(x, y, text, ha="center", va="bottom", fontsize=size, color=color)


def gradient_paths_figure():
    """Forward in grey, backward in purple: ``dy`` reaches ``x`` through the residual and
    through the branch as ``dn``; ``dX`` is their sum."""
    fig, ax = new_figure(figsize=(9.0, 3.6))
    bare_axes(ax, (0, 10.0), (0, 4.0), equal=True)
    yf, yb = 2.7, 1.3                      # forward row, backward row
    boxes = {"x": 0.7, "norm": 2.5, "branch": 5.3, "plus": 7.7, "y": 9.3}  # centers
    half = {"x": 0.45, "norm": 0.7, "branch": 1.2, "plus": 0.3, "y": 0.45}  # half widths
    for name, text, size in (("x", "x", 9), ("norm", "RMSNorm", 9),
                             ("branch", "branch: Q/K/V, RoPE,\nattention, wo", 8.5),
                             ("plus", "+", 12), ("y", "y", 9)):
        box(ax, boxes[name], yf, 2 * half[name], 0.6, text, size=size)
    for a, b in zip(list(boxes), list(boxes)[1:]):
        _arrow(ax, (boxes[a] + half[a], yf), (boxes[b] - half[b], yf), color=DENSE_COLOR, lw=1.2)
    ax.text(3.85, yf + 0.12, "n", ha="center", va="bottom", fontsize=10, color=DENSE_COLOR)
    # the residual: x jumps over norm and branch
    _arrow(ax, (boxes["x"], yf + 0.3), (boxes["plus"], yf + 0.3), color=DENSE_COLOR, lw=1.0,
           ls="--", rad=-0.25, text="residual", at=0.5, dy=0.55)
    # backward row
    box(ax, boxes["x"], yb, 0.9, 0.6, "dX", edge=GRAD_COLOR)
    box(ax, boxes["y"], yb, 0.9, 0.6, "dy", edge=GRAD_COLOR)
    _arrow(ax, (boxes["y"] - 0.45, yb + 0.1), (boxes["branch"] + 1.2, yb + 0.1),
           text="through the branch", dy=0.08)
    box(ax, boxes["branch"], yb, 2.4, 0.6, "branch backward", edge=GRAD_COLOR, size=8.5)
    _arrow(ax, (boxes["branch"] - 1.2, yb + 0.1), (boxes["norm"] + 0.7, yb + 0.1),
           text="dn", dy=0.08, size=10)
    box(ax, boxes["norm"], yb, 1.4, 0.6, "RMSNorm′ᵀ", edge=GRAD_COLOR)
    _arrow(ax, (boxes["norm"] - 0.7, yb + 0.1), (boxes["x"] + 0.45, yb + 0.1))
    _arrow(ax, (boxes["y"], yb - 0.3), (boxes["x"], yb - 0.3), ls="--", rad=-0.12)
    ax.text(5.3, yb - 0.6, "dy, through the residual", ha="center", va="top", fontsize=8.5,
            color=GRAD_COLOR)
    ax.text(3.85, yb + 0.62, "under TP, f sums dn = ∂L/∂n over the ranks here",
            ha="center", va="bottom", fontsize=8.5, color=FAIL_COLOR)
    ax.text(boxes["x"] - 0.45, yb + 0.4, "dX = dy + RMSNorm′ᵀ dn", ha="left", va="bottom",
            fontsize=9, color=GRAD_COLOR)
    ax.set_title("Two gradient paths into x: the residual and the branch", fontsize=11)
    return fig


def backward_flow_figure(cfg: Config | None = None):
    """One lane per rank: ``dy`` to every rank, f sums the ``dn_r``, RMSNorm's backward and
    the residual give ``dX``."""
    cfg = cfg or Config()
    world = cfg.world_size
    lane = 0.9
    height = max(3.4, lane * world + 1.9)
    fig, ax = new_figure(figsize=(10.0, max(3.4, 0.95 * height)))
    bare_axes(ax, (0, 11.0), (0, height), equal=True)
    mid = height / 2 + 0.35
    lanes = [mid + lane * ((world - 1) / 2 - r) for r in range(world)]
    x_dy, x_rank, x_sum, x_norm, x_plus, x_dx = 10.2, 7.4, 4.7, 2.6, 1.4, 0.45
    box(ax, x_dy, mid, 1.0, 0.6, "dy", edge=GRAD_COLOR)
    ax.text(x_dy + 0.1, mid + 0.45, "∂L/∂y", ha="left", va="bottom", fontsize=8,
            color=GRAD_COLOR)
    box(ax, x_sum, mid, 1.2, 0.7, "f: Σ\nall-reduce", edge=FAIL_COLOR, size=8.5,
         weight="bold")
    for rank, y in enumerate(lanes):
        color = rank_color(rank)
        _arrow(ax, (x_dy - 0.5, mid), (x_rank + 1.1, y), color=color, lw=1.2)
        box(ax, x_rank, y, 2.2, 0.55, f"rank {rank}: backward of\nits heads (Q/K/V, wo)",
             edge=color, size=7.5)
        _arrow(ax, (x_rank - 1.1, y), (x_sum + 0.6, mid), color=color, lw=1.2,
               text=f"dn_{rank}", at=0.45, dy=0.08 if y >= mid else -0.38)
    ax.text((x_dy + x_rank) / 2 + 0.25, max(lanes) + 0.35, "g's backward: dy to every rank",
            ha="center", va="bottom", fontsize=8, color=GRAD_COLOR)
    _arrow(ax, (x_sum - 0.6, mid), (x_norm + 0.65, mid), text="dn = Σ dn_r", dy=0.06)
    box(ax, x_norm, mid, 1.3, 0.6, "RMSNorm′ᵀ", edge=GRAD_COLOR)
    box(ax, x_plus, mid, 0.55, 0.55, "+", edge=GRAD_COLOR, size=12)
    _arrow(ax, (x_norm - 0.65, mid), (x_plus + 0.28, mid))
    box(ax, x_dx, mid, 0.8, 0.6, "dX", edge=GRAD_COLOR, weight="bold")
    _arrow(ax, (x_plus - 0.28, mid), (x_dx + 0.4, mid))
    bottom = min(lanes) - 0.55                # the residual runs below every lane
    ax.plot([x_dy, x_dy, x_plus], [mid - 0.3, bottom, bottom], color=GRAD_COLOR, lw=1.2,
            ls="--")
    _arrow(ax, (x_plus, bottom), (x_plus, mid - 0.28), ls="--", lw=1.2)
    ax.text((x_dy + x_plus) / 2, bottom - 0.08, "residual: dy, once (not once per rank)",
            ha="center", va="top", fontsize=8, color=GRAD_COLOR)
    ax.text(x_dx - 0.35, mid + 0.5, "dX = dy + RMSNorm′ᵀ(Σ dn_r)\non every rank; never "
            "all-reduced", ha="left", va="bottom", fontsize=8, color=GRAD_COLOR)
    ax.set_title(f"Backward through the sharded block, {world} ranks: f sums dn, not dX",
                 fontsize=11)
    return fig
