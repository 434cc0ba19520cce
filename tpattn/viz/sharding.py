"""Figures of sharding the block and breaking it (chapters 6–11); tensors are read only."""
from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.patches as mpatches
import torch

from tpattn.check.core import MEASURES, MODES, TOLERANCE
from tpattn.block.params import dense_shapes
from tpattn.config import Config
from .heads import draw_heads, heads_picture
from .style import DENSE_COLOR, FAIL_COLOR, PASS_COLOR, new_figure, rank_color, side_legend
from .tables import MEASURE_LABELS

__all__ = ["ZERO_FLOOR", "MODE_COLORS", "zero_floor", "value_label", "set_measures",
           "heads_to_ranks_figure", "weight_shards_figure", "measures_figure",
           "compare_measures_figure", "heatmaps_figure", "partial_vs_full_figure",
           "channel_bars_figure", "drift_figure", "matrix_figure", "ledger_figure",
           "rank_disagreement_figure"]

#: Where a value of exactly 0 is drawn on a log axis (and labelled "0").
ZERO_FLOOR = 1e-12

MODE_COLORS = dict(zip(MODES, (PASS_COLOR, FAIL_COLOR, "#9467bd")))


def heads_to_ranks_figure(cfg: Config, query_ranks: Sequence[int] | None = None):
    """``draw_heads(heads_picture(cfg, query_ranks))``."""
    return draw_heads(heads_picture(cfg, query_ranks))


def weight_shards_figure(cfg: Config):
    """The four weight matrices to scale, each rank's rows (``wo``: columns) in its color."""
    shapes = {name: shape for name, shape in dense_shapes(cfg).items() if name != "norm"}
    fig, axes = new_figure(ncols=4, figsize=(7.0, 2.8),
                           gridspec_kw={"width_ratios": [c for _, c in shapes.values()]})
    tallest = max(r for r, _ in shapes.values())
    for ax, (name, (rows, cols)) in zip(axes, shapes.items()):
        per_rank = (rows if name != "wo" else cols) // cfg.world_size
        for r in range(cfg.world_size):
            if name == "wo":
                xy, w, h = (r * per_rank, 0), per_rank, rows
            else:
                xy, w, h = (0, rows - (r + 1) * per_rank), cols, per_rank
            ax.add_patch(mpatches.Rectangle(xy, w, h, facecolor=rank_color(r),
                                            edgecolor="white", linewidth=1.5))
            ax.text(xy[0] + w / 2, xy[1] + h / 2, f"rank {r}", ha="center", va="center",
                    color="white", fontsize=8, fontweight="bold",
                    rotation=90 if name == "wo" else 0)
        ax.set(xlim=(0, cols), ylim=(rows - tallest, rows), aspect="equal", xticks=[], yticks=[])
        ax.spines[["left", "bottom"]].set_visible(False)
        kind = "columns → row-parallel" if name == "wo" else "rows → column-parallel"
        ax.set_title(f"{name} [{rows}, {cols}]\n{kind}", fontsize=9)
    return fig


def zero_floor(values: Sequence[float]) -> float:
    """Where 0 is drawn: ``ZERO_FLOOR``, or lower when a nonzero value is smaller than it."""
    smallest = min((v for v in values if v > 0), default=1.0)
    floor = ZERO_FLOOR
    while floor > smallest / 30:
        floor /= 10
    return floor


def value_label(v: float) -> str:
    """A bar's label: "0" for an exact zero, else two significant digits (``1.2e-07``)."""
    return "0" if v == 0 else f"{v:.1e}"


def _threshold_line(ax, floor: float, axis: str = "x") -> None:
    """Log scale from ``floor`` to 30 on ``axis``, the dashed 1e-6 line, labelled."""
    ax.set(**{f"{axis}scale": "log", f"{axis}lim": (floor / 3, 30)})
    (ax.axvline if axis == "x" else ax.axhline)(TOLERANCE, color="black", linestyle="--",
                                               linewidth=1)
    if axis == "x":
        ax.text(TOLERANCE * 1.3, 0.995, "threshold 1e-6", transform=ax.get_xaxis_transform(),
                va="top", ha="left", fontsize=8)
    else:
        ax.text(1.0, TOLERANCE, " 1e-6", transform=ax.get_yaxis_transform(), va="center",
                ha="left", fontsize=8)


def _log_ticks(top: float) -> tuple[list, list]:
    """Ticks and labels of a log axis from ``ZERO_FLOOR`` (labelled "0") to ``top``."""
    ticks = [t for t in (ZERO_FLOOR, 1e-9, TOLERANCE, 1e-3, 1) if t <= top]
    return ticks, ["0", "1e-9", "1e-6", "1e-3", "1"][:len(ticks)]


def _measure_bars(ax, ys, values, floor: float, fontsize: float, **style) -> None:
    """One bar per value at ``ys`` from ``floor / 3`` (0 at ``floor``), each labelled."""
    ax.barh(ys, [v or floor for v in values], left=floor / 3, **style)
    for y, v in zip(ys, values):
        ax.text((v or floor) * 1.4, y, value_label(v), va="center", fontsize=fontsize)


def _measures_axis(ax, floor: float) -> None:
    """The five measures' names (top first), the log axis from ``floor`` and the 1e-6 line."""
    ax.set_yticks(range(len(MEASURES))[::-1], [MEASURE_LABELS[m] for m in MEASURES])
    ax.set(ylim=(-0.5, len(MEASURES) + 0.1), xlabel="max |dense − TP|")
    _threshold_line(ax, floor, "x")


def measures_figure(result: Mapping):
    """One ``run()`` result: the five measures as log-scale bars, pass/fail colored, against the
    dashed 1e-6 line; an exact 0 is drawn at ``zero_floor`` and labelled "0"."""
    fig, ax = new_figure(figsize=(7.0, 2.6))
    values = [float(result[m]) for m in MEASURES]
    floor = zero_floor(values)
    _measure_bars(ax, list(range(len(MEASURES)))[::-1], values, floor, 8, height=0.6)
    _measures_axis(ax, floor)
    ax.set_title(" ")
    set_measures(fig, result)
    return fig


def set_measures(fig, result: Mapping) -> None:
    """Set a ``measures_figure`` of the same ``zero_floor`` to ``result``: bars, labels, title."""
    ax = fig.axes[0]
    values = [float(result[m]) for m in MEASURES]
    floor = zero_floor(values)
    for bar, label, value in zip(ax.patches, ax.texts, values):  # MEASURES order
        bar.set_width(value or floor)
        bar.set_facecolor(PASS_COLOR if value < TOLERANCE else FAIL_COLOR)
        label.set_x((value or floor) * 1.4)
        label.set_text(value_label(value))
    verdict = "PASSED" if result["passed"] else "FAILED"
    ax.title.set(text=f"seed {result['seed']}, mode {result['mode']}: {verdict}",
                 color=PASS_COLOR if result["passed"] else FAIL_COLOR)


def compare_measures_figure(results: Mapping[str, Mapping], title: str = ""):
    """Several results (label → result) as grouped bars per measure, as ``measures_figure``."""
    n = len(results)
    fig, ax = new_figure(figsize=(7.0, 1.2 + 0.25 * len(MEASURES) * n))
    floor = zero_floor([float(r[m]) for r in results.values() for m in MEASURES])
    height = 0.8 / n
    palette = ["#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#17becf"]
    for i, (label, result) in enumerate(results.items()):
        values = [float(result[m]) for m in MEASURES]
        ys = [len(MEASURES) - 1 - k + 0.4 - height * (i + 0.5) for k in range(len(MEASURES))]
        _measure_bars(ax, ys, values, floor, 7, height=height * 0.9,
                      color=palette[i % len(palette)], label=label)
    _measures_axis(ax, floor)
    side_legend(ax)
    ax.set_title(title)
    return fig


def heatmaps_figure(panels: Mapping[str, torch.Tensor], shared_scale: bool = True,
                    cmap: str = "RdBu_r", value_label: str = ""):
    """One heat map per ``[S, B, hidden]`` tensor (title → tensor) as ``[S, B·hidden]``;
    symmetric color scale, shared unless ``shared_scale=False``."""
    images = {name: t.detach().double().reshape(t.shape[0], -1)  # batch-major columns
              for name, t in panels.items()}
    fig, axes = new_figure(nrows=len(images), figsize=(7.0, 1.15 * len(images) + 0.5),
                           squeeze=False)
    axes = list(axes[:, 0])
    vmax_all = max(float(im.abs().max()) for im in images.values()) or 1.0
    first = next(iter(panels.values()))
    batch, hidden = (first.shape[1], first.shape[2]) if first.dim() == 3 else (1, first.shape[1])
    for ax, (name, im) in zip(axes, images.items()):
        vmax = vmax_all if shared_scale else (float(im.abs().max()) or 1.0)
        art = ax.imshow(im.numpy(), cmap=cmap, vmin=-vmax, vmax=vmax, aspect="auto",
                        interpolation="nearest")
        for b in range(1, batch):
            ax.axvline(b * hidden - 0.5, color="white", linewidth=2)
        ax.set_title(name, fontsize=9, loc="left")
        ax.set(ylabel="seq", yticks=range(im.shape[0]))
        ax.set_xticks([b * hidden + hidden / 2 - 0.5 for b in range(batch)],
                      [f"batch {b}" for b in range(batch)])
        if not shared_scale:
            fig.colorbar(art, ax=ax, fraction=0.03, pad=0.01, label=value_label)
    if shared_scale:
        fig.colorbar(art, ax=axes, fraction=0.03, pad=0.01, label=value_label)
    return fig


def partial_vs_full_figure(full: torch.Tensor, partials: Sequence[torch.Tensor]):
    """Each element of ``full`` ``[S, B, hidden]`` (x) against each rank's partial and their sum."""
    fig, ax = new_figure(figsize=(4.6, 4.0))
    xs = full.detach().flatten().to(torch.float64).numpy()
    for r, p in enumerate(partials):
        ax.scatter(xs, p.detach().flatten().to(torch.float64).numpy(), s=12, alpha=0.75,
                   color=rank_color(r), label=f"rank {r} partial")
    total = sum(p.detach() for p in partials)
    ax.scatter(xs, total.flatten().to(torch.float64).numpy(), s=30, facecolors="none",
               edgecolors="black", linewidths=0.8, label="sum of partials (g)")
    lim = 1.05 * max(abs(xs).max(), max(float(p.detach().abs().max()) for p in partials))
    ax.plot([-lim, lim], [-lim, lim], color="#888888", linestyle="--", linewidth=1)
    ax.set(xlim=(-lim, lim), ylim=(-lim, lim), aspect="equal",
           xlabel="full attention output (dense)", ylabel="what the rank holds",
           title="partials vs the full output, every element")
    ax.legend(fontsize=8, loc="upper left")
    return fig


def channel_bars_figure(series: Mapping[str, torch.Tensor], title: str = "", ylabel: str = ""):
    """Vectors of one length (label → ``[C]`` tensor) as grouped bars, one group per channel."""
    fig, ax = new_figure(figsize=(7.0, 2.8))
    n = len(series)
    width = 0.8 / n
    palette = ["#444444", "#9467bd", FAIL_COLOR, "#1f77b4"]
    for i, (label, values) in enumerate(series.items()):
        values = values.detach().to(torch.float64).flatten()
        xs = [c - 0.4 + width * (i + 0.5) for c in range(values.numel())]
        ax.bar(xs, values.numpy(), width=width * 0.95, color=palette[i % len(palette)], label=label)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set(xticks=range(values.numel()), xlabel="channel", ylabel=ylabel, title=title)
    side_legend(ax)
    return fig


def drift_figure(diffs: Mapping[str, Sequence[float]], losses: Mapping[str, Sequence[float]],
                 title: str = "max |W_bug − W_ref| after each step"):
    """Left: per name, a difference after each SGD step (log, 0 at ``ZERO_FLOOR``); right: each
    run's loss per step."""
    fig, (left, right) = new_figure(ncols=2, figsize=(7.5, 3.0))
    markers = ["o", "s", "^", "v", "D"]
    for i, (name, values) in enumerate(diffs.items()):
        steps = range(1, len(values) + 1)
        left.plot(steps, [v or ZERO_FLOOR for v in values], marker=markers[i % len(markers)],
                  markersize=4, label=name)
    left.set(yscale="log", ylim=(ZERO_FLOOR / 3, 1), xlabel="SGD step")
    left.axhline(TOLERANCE, color="black", linestyle="--", linewidth=1)
    left.set_yticks(*_log_ticks(1e-3))
    left.set_title(title, fontsize=10)
    left.legend(fontsize=7, ncol=2)
    palette = ["#444444", "#9467bd", "#1f77b4"]
    for i, (name, values) in enumerate(losses.items()):
        right.plot(range(1, len(values) + 1), values, color=palette[i % len(palette)],
                   linestyle=["-", "--", ":"][i % 3], label=name)
    right.set_xlabel("SGD step")
    right.set_title("loss at each step", fontsize=10)
    right.legend(fontsize=8)
    return fig


def matrix_figure(results: Sequence[Mapping]):
    """Every ``run_matrix()`` result: per measure a point per seed, colored by mode, log scale."""
    fig, ax = new_figure(figsize=(7.5, 3.4))
    modes = [m for m in MODES if any(r["mode"] == m for r in results)]
    offsets = {m: (i - (len(modes) - 1) / 2) * 0.25 for i, m in enumerate(modes)}
    for mode in modes:
        rows = [r for r in results if r["mode"] == mode]
        for k, measure in enumerate(MEASURES):
            xs = [k + offsets[mode] + (j - (len(rows) - 1) / 2) * 0.035 for j in range(len(rows))]
            ax.scatter(xs, [float(r[measure]) or ZERO_FLOOR for r in rows], s=18,
                       color=MODE_COLORS[mode], label=mode if k == 0 else None, zorder=3)
    _threshold_line(ax, ZERO_FLOOR, "y")
    ax.set_yticks(*_log_ticks(1))
    ax.set_xticks(range(len(MEASURES)), [MEASURE_LABELS[m].replace(" ", "\n", 1) for m in MEASURES],
                  fontsize=8)
    ax.set_ylabel("max |dense − TP|")
    side_legend(ax)
    seeds = sorted({r["seed"] for r in results})
    ax.set_title(f"{len(seeds)} seeds × {len(modes)} modes")
    return fig


def ledger_figure(ledger: Sequence[Mapping]):
    """Expected and actual all-reduces, forward and backward, per ``RealRankReport.ledger`` row."""
    if not ledger:
        raise ValueError("ledger must have at least one row (RealRankReport.ledger)")
    fig, axes = new_figure(ncols=2, figsize=(7.5, 3.2), sharey=True)
    labels = [f"{row['mode']}\n({row['variant']})" for row in ledger]
    positions = range(len(ledger))
    for ax, phase in zip(axes, ("forward", "backward")):
        expected = [row[f"{phase}_expected"] for row in ledger]
        actual = [row[f"{phase}_actual"] for row in ledger]
        colors = [PASS_COLOR if a == e else FAIL_COLOR for a, e in zip(actual, expected)]
        ax.barh(positions, expected, color="none", edgecolor=DENSE_COLOR, ls="--", height=0.7,
                label="expected")
        ax.barh(positions, actual, color=colors, height=0.45, label="actual")
        for y, (a, e, color) in enumerate(zip(actual, expected, colors)):
            ax.text(max(a, e) + 0.08, y, f"{a} of {e}" + ("" if a == e else "  missing"),
                    va="center", fontsize=8, color=DENSE_COLOR if a == e else color)
        most = max(*expected, *actual)
        ax.set(title=f"all-reduces in {phase}", xlim=(0, most + 1.6), xticks=range(most + 1))
    axes[0].invert_yaxis()  # first row on top (the axes share y: invert once)
    axes[0].set_yticks(list(positions), labels, fontsize=8)
    axes[1].legend(loc="upper right", fontsize=8)
    return fig


_QUANTITIES = {
    "output_max_rank_diff": ("output y", "#1f77b4"),
    "input_grad_max_rank_diff": ("input grad dX", "#ff7f0e"),
    "norm_grad_max_rank_diff": ("norm grad", "#8c564b"),
    "norm_after_step_max_rank_diff": ("norm after the step", "#7f7f7f"),
}


def rank_disagreement_figure(rows: Sequence[Mapping]):
    """Per mode, how far the ranks' copies are from rank 0's (``rank_disagreement`` rows)."""
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    if not modes:
        raise ValueError("rows must hold at least one run (RealRankReport.rank_disagreement)")
    fig, ax = new_figure(figsize=(7.5, 3.4))
    width = 0.8 / len(_QUANTITIES)
    for q, (key, (label, color)) in enumerate(_QUANTITIES.items()):
        for i, mode in enumerate(modes):
            value = max(r[key] for r in rows if r["mode"] == mode)
            x = i + (q - (len(_QUANTITIES) - 1) / 2) * width
            ax.bar(x, max(value - ZERO_FLOOR, 0), bottom=ZERO_FLOOR, width=width * 0.9,
                   color=color, label=label if i == 0 else None)
            ax.text(x, max(value, ZERO_FLOOR) * 1.6, "0" if value == 0 else f"{value:.0e}",
                    ha="center", fontsize=7)
    ax.axhline(TOLERANCE, color=DENSE_COLOR, ls="--", lw=0.8)
    ax.text(-0.45, TOLERANCE * 1.6, "1e-6", ha="left", fontsize=8, color=DENSE_COLOR)
    ax.set(yscale="log", ylim=(ZERO_FLOOR / 2, 1e4), ylabel="max |rank r copy − rank 0 copy|",
           title="Do the ranks hold the same values? (0 drawn at 1e-12)")
    ax.set_xticks(range(len(modes)), modes)
    ax.legend(fontsize=8, loc="upper center", ncols=4, frameon=False)
    return fig
