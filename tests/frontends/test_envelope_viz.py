"""tpattn.viz.envelope: the figure draws the envelope, its margin shaded, the run, the drift,
log y, and a line at the step where a bug leaves; mismatched curves are a ValueError."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tpattn.bugs.lm_curves import MARGIN, mode_curves  # noqa: E402
from tpattn.viz.envelope import envelope_figure  # noqa: E402


def test_a_bug_is_drawn_with_its_step_marked_on_a_log_axis():
    curves = mode_curves("mlp_output_reduce_missing", 3, 5)
    fig = envelope_figure(curves, MARGIN)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    labels = [line.get_label() for line in ax.get_lines()]
    assert {"envelope (twins' largest)", "TP run vs dense", "training's own drift"} <= set(labels)
    run = next(line for line in ax.get_lines() if line.get_label() == "TP run vs dense")
    assert list(run.get_ydata()) == pytest.approx(curves["divergence"].tolist())
    marks = [line for line in ax.get_lines() if list(line.get_xdata()) == [1, 1]]
    assert len(marks) == 1 and any("leaves at step 1" in t.get_text() for t in ax.texts)
    assert ax.get_title() == "bug from step 1"
    plt.close(fig)


def test_correct_tp_has_no_mark_and_bad_curves_are_a_value_error():
    curves = mode_curves("lm_equivalence", 3, 5)
    fig = envelope_figure(curves, MARGIN, title="correct")
    assert not fig.axes[0].texts and fig.axes[0].get_title() == "correct"
    plt.close(fig)
    with pytest.raises(ValueError, match="divergence and envelope must be two equal"):
        envelope_figure(dict(curves, envelope=torch.ones(3)), MARGIN)
