"""Figures of chapter 14 (Equal at scale): measures against their ``tolerance="auto"`` bound."""
from __future__ import annotations

from .style import FAIL_COLOR, PASS_COLOR, new_figure, side_legend

__all__ = ["bound_ratio_figure"]

_DTYPES = ("float64", "float32", "bfloat16")
_STYLES = {"equivalence": ("o", PASS_COLOR, None),
           "missing_output_reduce": ("^", FAIL_COLOR, None),
           "missing_input_grad_reduce": ("s", FAIL_COLOR, "none")}


def bound_ratio_figure(rows: list[dict], title: str = "measure / bound, largest of the five"):
    """Each ``compare_world_sizes`` row's largest ``measure / bound`` by dtype and world size."""
    fig, ax = new_figure(figsize=(7.0, 3.4))
    groups = sorted({(r["dtype"], r["world_size"]) for r in rows},
                    key=lambda g: (_DTYPES.index(g[0]), g[1]))
    xpos = {g: i for i, g in enumerate(groups)}
    for mode, (marker, color, face) in _STYLES.items():
        pts = [(xpos[(r["dtype"], r["world_size"])], max(r["ratios"].values()))
               for r in rows if r["mode"] == mode]
        if not pts:
            continue
        xs, ys = zip(*pts)
        ys = [max(y, 1e-6) for y in ys]  # an exact 0 is drawn on the floor of the axis
        ax.scatter(xs, ys, marker=marker, s=28, alpha=0.8, label=mode, color=color, facecolors=face)
    ax.axhline(1.0, color="#444444", lw=1)
    ax.axhline(100.0, color="#444444", lw=1, ls=":")
    ax.set(yscale="log", ylim=(1e-6 / 2, None), ylabel="measure / bound", title=title)
    ax.set_xticks(range(len(groups)), [f"{d}\nTP {w}" for d, w in groups], fontsize=8)
    side_legend(ax, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return fig
