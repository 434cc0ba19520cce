"""Loss curves side by side (chapter 9): one panel per setting, one line per run."""
from __future__ import annotations

from typing import Mapping, Sequence

from .style import new_figure

__all__ = ["final_gap", "loss_curves_figure"]

STYLES = (("#1f77b4", "-"), ("#d62728", "--"), ("#444444", ":"))


def final_gap(losses: Sequence[float], reference: Sequence[float]) -> float:
    """``|losses[-1] - reference[-1]| / |reference[-1]|`` (both non-empty, the latter nonzero)."""
    if not losses or not reference:
        raise ValueError("losses and reference must each hold at least one step (got none)")
    if reference[-1] == 0:
        raise ValueError("reference's last loss must be nonzero (got 0)")
    return abs(losses[-1] - reference[-1]) / abs(reference[-1])


def loss_curves_figure(panels: Mapping[str, Mapping[str, Sequence[float]]], title: str = ""):
    """``{panel title: {run label: loss per step}}`` as panels (shared y), a line per run; a
    title adds the last step's gap of its second run to its first (``final_gap``)."""
    if not panels or any(not runs for runs in panels.values()):
        raise ValueError("panels must hold at least one panel, each with at least one run")
    fig, axes = new_figure(ncols=len(panels), figsize=(3.6 * len(panels) + 0.4, 3.0),
                           sharey=True, squeeze=False)
    for ax, (name, runs) in zip(axes[0], panels.items()):
        for (label, losses), (color, style) in zip(runs.items(), STYLES):
            ax.plot(range(1, len(losses) + 1), losses, color=color, linestyle=style, label=label)
        heading = name
        if len(runs) > 1:
            first, second = list(runs.values())[:2]
            heading += f" (last step: {100 * final_gap(second, first):.1f}% apart)"
        ax.set_title(heading, fontsize=10)
        ax.set_xlabel("SGD step")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("loss")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
