"""Figures for chapter 11 from what ``run_distributed`` reports (plain dicts)."""
from __future__ import annotations

from typing import Mapping, Sequence

from tpattn.check.core import MEASURES, MODES, TOLERANCE
from .sharding import MEASURE_LABELS, MODE_COLORS, ZERO_FLOOR
from .style import DENSE_COLOR, FAIL_COLOR, PASS_COLOR, new_figure

__all__ = ["real_vs_simulated_figure", "ledger_figure", "rank_disagreement_figure"]

_MEASURE_MARKERS = dict(zip(MEASURES, ["o", "s", "^", "D", "v"]))


def real_vs_simulated_figure(real: Sequence[Mapping], simulated: Sequence[Mapping]):
    """Every measure of every run: simulated (x) against real ranks (y), log-log; color is the
    mode, marker the measure."""
    if len(real) != len(simulated) or not real:
        raise ValueError(f"real and simulated must list the same runs (got {len(real)} and "
                         f"{len(simulated)} results)")
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (mode, measure) -> (x, y)
    for r, s in zip(real, simulated):
        if (r["seed"], r["mode"]) != (s["seed"], s["mode"]):
            raise ValueError("real and simulated must list the same runs in the same order "
                             f"(got seed {r['seed']} {r['mode']} vs seed {s['seed']} {s['mode']})")
        for m in MEASURES:
            points.setdefault((r["mode"], m), []).append((max(s[m], ZERO_FLOOR),
                                                         max(r[m], ZERO_FLOOR)))
    fig, ax = new_figure(figsize=(7.0, 4.6))
    for (mode, m), xy in points.items():
        ax.scatter(*zip(*xy), color=MODE_COLORS[mode], marker=_MEASURE_MARKERS[m], s=28,
                   alpha=0.8, edgecolor="none")
    ax.set(xscale="log", yscale="log")
    lo, hi = ZERO_FLOOR / 3, 3.0
    ax.plot([lo, hi], [lo, hi], color=DENSE_COLOR, lw=0.8, zorder=0)
    for line in (ax.axvline, ax.axhline):
        line(TOLERANCE, color=DENSE_COLOR, ls="--", lw=0.8, zorder=0)
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="simulated ranks (one process)",
           ylabel="real ranks (one process per rank)",
           title="The same measures, simulated vs real ranks (0 drawn at 1e-12)")
    modes = [ax.scatter([], [], color=MODE_COLORS[m], marker="o", label=m) for m in MODES]
    measures = [ax.scatter([], [], color="#999999", marker=_MEASURE_MARKERS[m],
                           label=MEASURE_LABELS[m]) for m in MEASURES]
    first = ax.legend(handles=modes, loc="upper left", fontsize=8, title="mode", title_fontsize=8)
    ax.add_artist(first)
    ax.legend(handles=measures, loc="lower right", fontsize=8, title="measure", title_fontsize=8)
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
