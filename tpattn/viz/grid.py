"""A stack's result as a blocks × parameters grid (chapter 9): which gradients are wrong where."""
from __future__ import annotations

from matplotlib.colors import ListedColormap

from .style import new_figure

__all__ = ["stack_grid", "stack_grid_figure"]

OK_COLOR, WRONG_COLOR = "#d9f0d3", "#f4a582"


def stack_grid(grad_diffs: list[dict[str, float]], tolerance: float) -> tuple[list, list, list]:
    """``(row_labels, names, wrong)`` of ``run_stack``'s ``grad_diffs`` (a dict per block,
    block 0 the bottom): rows top block first, ``wrong[row][col]``: diff >= ``tolerance``."""
    if not grad_diffs:
        raise ValueError("grad_diffs must hold at least one block (got none)")
    names = list(grad_diffs[0])
    top = len(grad_diffs) - 1
    rows = list(reversed(range(len(grad_diffs))))
    labels = [f"block {b}" + (" (top)" if b == top else "") for b in rows]
    wrong = [[grad_diffs[b][n] >= tolerance for n in names] for b in rows]
    return labels, names, wrong


def stack_grid_figure(grad_diffs: list[dict[str, float]], tolerance: float, title: str = ""):
    """``stack_grid`` as a grid of cells: red "WRONG" or green "ok"."""
    labels, names, wrong = stack_grid(grad_diffs, tolerance)
    fig, ax = new_figure(figsize=(1.1 * len(names) + 1.6, 0.45 * len(labels) + 0.9))
    ax.imshow([[float(w) for w in row] for row in wrong], aspect="auto", vmin=0, vmax=1,
              cmap=ListedColormap([OK_COLOR, WRONG_COLOR]))
    for r, row in enumerate(wrong):
        for c, w in enumerate(row):
            ax.text(c, r, "WRONG" if w else "ok", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(names)), names)
    ax.set_yticks(range(len(labels)), labels)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    ax.spines[:].set_visible(False)
    ax.set_xticks([x - 0.5 for x in range(1, len(names))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(labels))], minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.grid(which="major", visible=False)
    ax.set_title(title, fontsize=10)
    return fig
