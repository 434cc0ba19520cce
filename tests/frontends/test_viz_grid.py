"""tpattn.viz.grid: the blocks × parameters grid says WRONG exactly where run_stack does."""
import pytest

import tpattn
from tpattn.bugs.modes import resolve
from tpattn.check.stack import run_stack


def test_grid_marks_the_wrong_gradients_top_block_first():
    pytest.importorskip("matplotlib")
    from tpattn.viz.grid import stack_grid, stack_grid_figure

    stacked = run_stack(5, resolve(tpattn.MISSING_INPUT_GRAD_REDUCE), layers=3)   # seed 5: held out
    labels, names, wrong = stack_grid(stacked["grad_diffs"], tpattn.TOLERANCE)
    assert labels == ["block 2 (top)", "block 1", "block 0"]
    assert wrong[0] == [n == "norm" for n in names]          # top: only norm
    assert all(all(row) for row in wrong[1:])                # below: everything
    fig = stack_grid_figure(stacked["grad_diffs"], tpattn.TOLERANCE)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts.count("WRONG") == sum(map(sum, wrong)) and texts.count("ok") == 4
    with pytest.raises(ValueError, match="grad_diffs"):
        stack_grid([], tpattn.TOLERANCE)
