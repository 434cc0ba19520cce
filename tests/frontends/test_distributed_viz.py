"""Figures of chapter 11 (``tpattn.viz.sharding``), drawn from report-shaped dicts: no processes.

Each figure must draw every point/bar it is given and refuse input it cannot draw with a
``ValueError`` naming the argument.
"""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import tpattn  # noqa: E402
from tpattn import viz  # noqa: E402

LEDGER = [
    {"variant": "tpattn f/g", "mode": m, "forward_expected": 1, "backward_expected": 1,
     "forward_actual": int(m != tpattn.MISSING_OUTPUT_REDUCE),
     "backward_actual": int(m != tpattn.MISSING_INPUT_GRAD_REDUCE)} for m in tpattn.MODES
] + [{"variant": "DTensor parallelize_module", "mode": "equivalence", "forward_expected": 1,
      "forward_actual": 1, "backward_expected": 3, "backward_actual": 3}]

DISAGREEMENT = [{"seed": s, "mode": m, "output_max_rank_diff": 0.0,
                 "input_grad_max_rank_diff": 0.0 if m == "equivalence" else 1e-2,
                 "norm_grad_max_rank_diff": 0.0 if m == "equivalence" else 3e-2,
                 "norm_after_step_max_rank_diff": 0.0 if m == "equivalence" else 1.5e-3}
                for m in tpattn.MODES for s in (11, 17)]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_ledger_figure_marks_missing_collectives():
    fig = viz.ledger_figure(LEDGER)
    forward, backward = fig.axes
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts.count("0 of 1  missing") == 2 and "3 of 3" in texts
    assert len(forward.patches) == len(backward.patches) == 2 * len(LEDGER)  # expected + actual
    with pytest.raises(ValueError, match="ledger must have at least one row"):
        viz.ledger_figure([])


def test_rank_disagreement_figure_labels_exact_zeros():
    fig = viz.rank_disagreement_figure(DISAGREEMENT)
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.texts]
    assert labels.count("0") == 4 + 1 + 1  # equivalence: all four; the two bugs: output only
    assert [t.get_text() for t in ax.get_xticklabels()] == list(tpattn.MODES)
    with pytest.raises(ValueError, match="rows must hold at least one run"):
        viz.rank_disagreement_figure([])
