"""Diagrams of the block: its map, its gradient paths (dense and sharded); float32 rounding."""
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
from .style import (DENSE_COLOR, FAIL_COLOR, PASS_COLOR, arrow, bare_axes, box, new_figure,
                    rank_color)
from tpattn.bugs.modes import run

__all__ = ["rank_heads", "block_map_figure", "float32_rounding_errors", "float32_rounding_figure",
           "gradient_paths_figure", "backward_flow_figure"]

_F_G_COLOR = "#6a3d9a"  # the two collectives
GRAD_COLOR = "#7b3294"
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
    _boxed(ax, 16, mid, 9, 6, f"{rms_norm.__name__}\n(norm: every\nrank the same)", DENSE_COLOR,
           size=8)
    arrow(ax, (7.8, mid), (11.2, mid))
    # f: one tensor in, one copy per rank out
    _boxed(ax, 29, mid, 10.5, 9,
           f"f\n{copy_to_ranks.__name__}\nfwd: identity\nbwd: all-reduce dn", _F_G_COLOR,
           face="#f3eef8", size=8)
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
    # backward row, under the forward boxes: dy → branch → RMSNorm′ᵀ → dX
    for name, text in (("x", "dX"), ("y", "dy"), ("branch", "branch backward"),
                       ("norm", "RMSNorm′ᵀ")):
        box(ax, boxes[name], yb, 2 * half[name], 0.6, text, edge=GRAD_COLOR,
            size=8.5 if name == "branch" else 9)
    for a, b, text, size in (("y", "branch", "through the branch", 8.5),
                             ("branch", "norm", "dn", 10), ("norm", "x", None, 8.5)):
        _arrow(ax, (boxes[a] - half[a], yb + 0.1), (boxes[b] + half[b], yb + 0.1), text=text,
               dy=0.08, size=size)
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
    ax.text(x_dy + 0.1, mid + 0.45, "∂L/∂y", ha="left", va="bottom", fontsize=8, color=GRAD_COLOR)
    box(ax, x_sum, mid, 1.2, 0.7, "f: Σ\nall-reduce", edge=FAIL_COLOR, size=8.5, weight="bold")
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
    ax.plot([x_dy, x_dy, x_plus], [mid - 0.3, bottom, bottom], color=GRAD_COLOR, lw=1.2, ls="--")
    _arrow(ax, (x_plus, bottom), (x_plus, mid - 0.28), ls="--", lw=1.2)
    ax.text((x_dy + x_plus) / 2, bottom - 0.08, "residual: dy, once (not once per rank)",
            ha="center", va="top", fontsize=8, color=GRAD_COLOR)
    ax.text(x_dx - 0.35, mid + 0.5, "dX = dy + RMSNorm′ᵀ(Σ dn_r)\non every rank; never "
            "all-reduced", ha="left", va="bottom", fontsize=8, color=GRAD_COLOR)
    ax.set_title(f"Backward through the sharded block, {world} ranks: f sums dn, not dX",
                 fontsize=11)
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
