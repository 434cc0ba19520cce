"""Properties over random Configs: correct TP equals dense; each bug mode is caught.

Tolerance: the verdict's absolute 1e-6. Correct TP differs from dense only by float rounding
(summation order of the rank partials), ~1 ulp of the outputs, and how many ulps depends on the
machine (BLAS, instruction set, threads). In float32 that stays below 1e-6 only at the seed's
scale: wo's fan-in query_heads*head_dim <= 16 (the seed's own). Over 1,500 random Configs the
worst was 4.8e-7 (1 ulp of an output in [4, 8)) up to fan-in 32, and 2.1e-6 at fan-in 48..192;
fan-in 16 keeps the sums as short as the seed's, so a machine that rounds one ulp more still
passes (see NOTES "Tolerances at realistic sizes"). float64
rounding is ~1e-15, so it is tested at every size.
"""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tpattn
from tpattn import EQUIVALENCE, MISSING_INPUT_GRAD_REDUCE, MISSING_OUTPUT_REDUCE

from tests.strategies import valid_configs


def at_seed_scale(cfg):
    return cfg.dtype == "float64" or cfg.query_heads * cfg.head_dim <= 16


@given(cfg=valid_configs().filter(at_seed_scale), seed=st.integers(0, 2**32))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
def test_correct_tp_passes_equivalence(cfg, seed):
    result = tpattn.run(seed, EQUIVALENCE, cfg)
    assert result["passed"], result


@given(cfg=valid_configs(world_sizes=(2, 4, 8)), seed=st.integers(0, 2**32))
@settings(max_examples=40, deadline=None)
def test_both_bug_modes_fail_equivalence(cfg, seed):
    missing_g = tpattn.run(seed, MISSING_OUTPUT_REDUCE, cfg)
    missing_f = tpattn.run(seed, MISSING_INPUT_GRAD_REDUCE, cfg)
    assert not missing_g["passed"] and missing_g["forward_max_abs_diff"] > 1e-6, missing_g
    # missing f is caught in backward: dX, or (hidden=1, where RMSNorm's output is sign(x) and
    # its Jacobian vanishes, so dX cannot show it) the `norm` gradient.
    assert not missing_f["passed"], missing_f
    assert max(missing_f["input_grad_max_abs_diff"], missing_f["parameter_grad_max_abs_diff"]) > 1e-6


@given(cfg=valid_configs(world_sizes=(2, 4, 8)), seed=st.integers(0, 2**32))
@settings(max_examples=25, deadline=None)
def test_missing_f_leaves_forward_and_loss_identical_to_correct_tp(cfg, seed):
    """f's all-reduce acts only in backward: dropping it cannot change a single forward bit."""
    ok = tpattn.run(seed, EQUIVALENCE, cfg)
    bad = tpattn.run(seed, MISSING_INPUT_GRAD_REDUCE, cfg)
    assert bad["forward_max_abs_diff"] == ok["forward_max_abs_diff"]
    assert bad["loss_abs_diff"] == ok["loss_abs_diff"]


@given(cfg=valid_configs(world_sizes=(1,)), seed=st.integers(0, 2**32))
@settings(max_examples=15, deadline=None)
def test_with_one_rank_the_bug_modes_change_nothing(cfg, seed):
    """With one rank there is nothing to reduce: every mode is the correct block."""
    for mode in tpattn.MODES:
        assert tpattn.run(seed, mode, cfg)["passed"]
