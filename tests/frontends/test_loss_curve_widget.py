"""The loss-curve explorer (chapter 20): a verdict line and the figure per state; bad input is a
one-line message, never a traceback; the static twin has a panel per LM mode and dtype."""
from tpattn.bugs.lm_zoo import LM_REGISTRY
from tpattn.widgets.loss_curve import MAX_STEPS, loss_curve_explorer


def test_the_explorer_shows_the_verdict_line_and_the_figure():
    e = loss_curve_explorer(steps=4, seed=3)
    text, png = e.output.outputs
    assert text["data"]["text/plain"].startswith("lm_equivalence, 4 steps: rounding; largest")
    assert "image/png" in png["data"]
    e.set(mode="mlp_output_reduce_missing")
    assert "bug from step 1" in e.output.outputs[0]["data"]["text/plain"]


def test_bad_input_is_a_one_line_message():
    e = loss_curve_explorer(steps=4, seed=3)
    for values, message in (({"seed": -2}, "seed must be an integer >= 0"),
                            ({"steps": MAX_STEPS + 1}, "steps must be an integer from 1")):
        out = e.outputs(**{**e.values, **values})
        assert len(out) == 1
        shown = out[0]["data"]["text/plain"]
        assert message in shown and "Traceback" not in shown and "\n" not in shown


def test_the_static_twin_has_a_panel_per_mode_and_dtype():
    twin = loss_curve_explorer(steps=2, seed=3).static()
    assert len(twin) == 2 * len(LM_REGISTRY)
    assert "bug from step 1" in twin.panels[(1, 0)]
