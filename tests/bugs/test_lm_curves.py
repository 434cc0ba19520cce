"""tpattn.bugs.lm_curves: the
chapter's curves judge correct TP "rounding" and a dropped collective a bug from step 1; the
dense run and envelope are computed once per case; bad arguments raise ValueError."""
from dataclasses import replace

import pytest

from tpattn.bugs.lm_curves import CURVE_LM, mode_curves, reference_for, training_modes
from tpattn.bugs.lm_zoo import LM_EQUIVALENCE, LM_REGISTRY


def test_training_modes_leave_out_correct_and_unknown_modes_are_refused():
    assert training_modes() == [m for m in LM_REGISTRY if m != LM_EQUIVALENCE]
    with pytest.raises(ValueError, match="mode must be one of the LM's modes"):
        mode_curves("equivalence", 3, 6)


def test_correct_tp_is_rounding_and_a_dropped_f_leaves_at_step_one():
    right = mode_curves(LM_EQUIVALENCE, 3, 6)
    assert (right["kind"], right["left"], right["text"]) == ("rounding", None, "rounding")
    assert float(right["ratio"].max()) < 4.0
    bug = mode_curves("mlp_input_grad_reduce_missing", 3, 6)
    assert (bug["kind"], bug["left"], bug["text"]) == ("bug", 1, "bug from step 1")
    assert bug["envelope"] is right["envelope"]  # one reference per case


def test_the_reference_does_not_depend_on_the_world_size():
    four = replace(CURVE_LM, block=replace(CURVE_LM.block, world_size=4))
    assert reference_for(four, False, 3, 6) is reference_for(CURVE_LM, False, 3, 6)
    assert reference_for(CURVE_LM, True, 3, 6) is not reference_for(CURVE_LM, False, 3, 6)


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "float16"}, "dtype must be 'float32' or 'bfloat16'"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"steps": 0}, "steps must be an integer >= 1"),
])
def test_bad_arguments_raise_value_errors_naming_the_field(kwargs, message):
    args = {"mode": LM_EQUIVALENCE, "seed": 3, "steps": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        mode_curves(**args)
