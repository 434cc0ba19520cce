"""tolerance="auto": correct TP passes, every bug fails by a margin, the default is untouched.

The bound (``tpattn.check.tolerance``) is ``rho * scale`` with ``rho = u_acc sqrt(n) + u (W + 4)``.
These tests are where its empirical constant ``C = 1`` is tested: over random shapes, world
sizes 1-8 and all three dtypes, correct TP (both TP paths) stays below it, and a missing
reduction exceeds it by >= 100x in float32/float64 (bfloat16: see ``BF16_MARGIN``). The
Llama-3-8B-shape evidence is bench/tolerance_sweep.py's JSON, checked here too.
"""
import json
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tpattn.bugs.modes import resolve_all
from tpattn.bugs.zoo import REGISTRY
import tpattn
from tpattn import EQUIVALENCE, MISSING_INPUT_GRAD_REDUCE, MISSING_OUTPUT_REDUCE, MODES, Config
from tpattn.check.at_scale import against_float64, compare_world_sizes
from tpattn.check.core import (LR, PARAM_SEED_OFFSET, dense_reference, five_measures, make_inputs,
                          one_step)
from tpattn.cli import main
from tpattn.block.params import init_params
from tpattn.parallel.one_graph import one_graph_forward
from tpattn.check.tolerance import (PARAMETER_MEASURES, UNIT_ROUNDOFF, check_tolerance, fan_in,
                                    per_parameter, ratios, relative_bound)
from tpattn.parallel.tp import tp_forward

from tests.conftest import ROOT
from tests.strategies import valid_configs

ALL_DTYPES = ("float32", "float64", "bfloat16")
#: float32/float64 bugs must exceed the bound by this factor (the issue's requirement).
MARGIN = 100
#: bfloat16 cannot: its u = 2**-8 puts the bound at rho >= 6u ~ 2% of the scale, while a
#: missing reduction changes a measure by a relative O(1) or (tiny shapes, small attention
#: branch) less. Required: the bug still fails.
BF16_MARGIN = 1
SWEEP = ROOT / "book" / "data" / "equal_at_scale.json"


def needed_margin(cfg):
    return BF16_MARGIN if cfg.dtype == "bfloat16" else MARGIN


#: A bug's exact effect must exceed this many bounds before a low-precision run is required
#: to see it: the low-precision difference is the exact effect give or take the dense side's
#: and the buggy side's own rounding, each within one bound of float64
#: (``test_low_precision_dense_is_within_its_bound_of_float64``).
VISIBLE = 3


def exact_effect(cfg, seed, mode, bounds, init="seed"):
    """``max_m |bug - dense|_m / bound_m`` computed in float64 on ``cfg``'s own numbers (its
    inputs and parameters cast up exactly): how large the bug is before any rounding. The
    parameter measures take each parameter against its own bound (``per_parameter`` at
    ``cfg``'s precision): a bug confined to one small parameter is measured against that
    parameter's bound, not against the bound of the parameter the low-precision run named."""
    x0, target = make_inputs(cfg, seed)
    base = init_params(cfg, seed + PARAM_SEED_OFFSET, init)
    cfg64 = replace(cfg, dtype="float64")
    x64, t64, p64 = x0.double(), target.double(), {k: v.double() for k, v in base.items()}
    kw = dict(reduce_output=mode != MISSING_OUTPUT_REDUCE,
              reduce_input_grad=mode != MISSING_INPUT_GRAD_REDUCE)
    bug = one_step(lambda x, p: tp_forward(x, p, cfg64, **kw), x64, t64, p64)
    dense = dense_reference(x64, t64, p64, cfg64)
    metrics, own = per_parameter(cfg, five_measures(seed, mode, dense, bug), dense, bug, LR)
    return max(ratios(metrics, {**bounds, **{m: own[m] for m in PARAMETER_MEASURES}}).values())


def assert_inconclusive_is_conditioning(result):
    """An "inconclusive" correct run: the step amplifies rounding (A > 1), the reason says so,
    and every measure lies within its floor (never above: that would be "fail")."""
    assert result["verdict"] == "inconclusive" and result["amplification"] > 1, result
    assert result["reason"].startswith("rounding is amplified"), result
    assert all(result[m] <= result["floors"][m] for m in result["bounds"]), result


def assert_bug_fails(result, cfg, seed, init="seed"):
    """A bug run fails by the dtype's margin, unless in bfloat16 the bug itself is below
    bfloat16's resolution at this shape (hidden=1, seq=1: the attention branch rounds away
    against the residual); then its exact effect must be shown to be that small."""
    margin = max(ratios(result, result["bounds"]).values())  # how far it fails
    if cfg.dtype == "bfloat16" and result["passed"]:
        assert exact_effect(cfg, seed, result["mode"], result["bounds"], init) < VISIBLE, result
        return
    assert not result["passed"], result
    assert margin >= needed_margin(cfg), result


@given(cfg=valid_configs(dtypes=ALL_DTYPES, max_seq=8, max_hidden=48),
       seed=st.integers(0, 2**32))
@settings(max_examples=30, deadline=None)
@example(cfg=Config(seq=1, batch=1, hidden=1, query_heads=4, kv_heads=2, head_dim=2,
                    world_size=2), seed=573)
def test_correct_tp_passes_auto_at_every_shape_dtype_and_world_size(cfg, seed):
    result = tpattn.run(seed, EQUIVALENCE, cfg, tolerance="auto")
    if result["verdict"] == "inconclusive":
        # never "fail"; inconclusive only where the step amplifies rounding (A > 1) and every
        # measure is within its floor max(1, A) x bound. Hypothesis found the example above:
        # one token of hidden 1 (rms_norm is sign(x)), amplification ~45 on every kernel.
        assert_inconclusive_is_conditioning(result)
        return
    assert result["passed"], result


@given(cfg=valid_configs(world_sizes=(2, 4, 8), dtypes=ALL_DTYPES, max_seq=8, max_hidden=48),
       seed=st.integers(0, 2**32), mode=st.sampled_from(MODES[1:]))
@settings(max_examples=30, deadline=None)
@example(cfg=Config(seq=3, batch=1, hidden=1, query_heads=8, kv_heads=8, head_dim=8,
                    world_size=8, dtype="bfloat16"), seed=3273700, mode=MISSING_INPUT_GRAD_REDUCE)
def test_each_bug_fails_auto_by_the_margin(cfg, seed, mode):
    # Hypothesis found the example: missing f changes only the norm weight's gradient here
    # (hidden 1), by 1e-3 against that gradient's own bfloat16 bound of 5e-3 (ratio 0.2).
    assert_bug_fails(tpattn.run(seed, mode, cfg, tolerance="auto"), cfg, seed)


@given(cfg=valid_configs(dtypes=ALL_DTYPES, max_seq=6, max_hidden=32), seed=st.integers(0, 999))
@settings(max_examples=20, deadline=None)
@example(cfg=Config(seq=2, batch=2, hidden=1, query_heads=8, kv_heads=4, head_dim=6,
                    world_size=2), seed=860)
def test_the_seed_loop_also_passes_the_auto_bounds(cfg, seed):
    # The example: hidden 1 makes every token's normalized input +-norm, so wk's gradient
    # cancels to ~1e-8 of its summands; against |dL/dwk| correct TP "failed" by 1e5x.
    for row in compare_world_sizes(cfg, seed, resolve_all(tpattn.MODES), world_sizes=(cfg.world_size,), init="seed",
                                   path="loop"):
        if row["mode"] == EQUIVALENCE:
            if row["verdict"] == "inconclusive":
                assert_inconclusive_is_conditioning(row)
            else:
                assert row["passed"], row
        else:
            assert_bug_fails(row, cfg, seed)


def test_a_bug_below_bfloat16_resolution_is_recognised_as_such():
    # Hypothesis found this shape: one token, hidden=1. In bfloat16 the attention branch
    # rounds away against the residual, so neither reduction's absence is visible -- and the
    # float64 effect on the same numbers says the bug is below the bound, not that it is gone.
    cfg = Config(seq=1, batch=1, hidden=1, query_heads=2, kv_heads=2, head_dim=2,
                 world_size=2, dtype="bfloat16")
    row = tpattn.run(1, MISSING_INPUT_GRAD_REDUCE, cfg, tolerance="auto")
    assert row["passed"]
    assert exact_effect(cfg, 1, MISSING_INPUT_GRAD_REDUCE, row["bounds"]) < VISIBLE
    # The same bug at a real width is far above the bound in bfloat16 too.
    wide = replace(cfg, seq=4, hidden=32)
    row = tpattn.run(1, MISSING_INPUT_GRAD_REDUCE, wide, tolerance="auto")
    assert not row["passed"]
    assert exact_effect(wide, 1, MISSING_INPUT_GRAD_REDUCE, row["bounds"]) >= VISIBLE


@given(cfg=valid_configs(dtypes=("float64",), max_seq=6, max_hidden=32),
       seed=st.integers(0, 999), mode=st.sampled_from(MODES))
@settings(max_examples=30, deadline=None)
def test_engine_one_graph_path_is_the_seed_loop_in_float64(cfg, seed, mode):
    """tolerance="auto"'s TP side (the engine on OneGraphRanks) is tp_forward's step."""
    x0, target = make_inputs(cfg, seed)
    base = init_params(cfg, seed)
    kw = dict(reduce_output=mode != MISSING_OUTPUT_REDUCE,
              reduce_input_grad=mode != MISSING_INPUT_GRAD_REDUCE)
    a = one_step(lambda x, p: tp_forward(x, p, cfg, **kw), x0, target, base)
    b = one_step(lambda x, p: one_graph_forward(x, p, cfg, REGISTRY[mode].injection),
                 x0, target, base)
    for key in ("output", "loss", "input_grad"):
        torch.testing.assert_close(a[key], b[key], rtol=1e-12, atol=1e-12)
    for k in a["grads"]:
        torch.testing.assert_close(a["grads"][k], b["grads"][k], rtol=1e-12, atol=1e-12)


def test_default_tolerance_is_the_seed_bit_for_bit():
    for mode in MODES:
        assert tpattn.run(11, mode) == tpattn.run(11, mode, tolerance="seed")
    assert tpattn.run_matrix([3], cfg=Config(world_size=1)) == tpattn.run_matrix(
        [3], cfg=Config(world_size=1), tolerance="seed")


def test_auto_adds_bounds_and_the_verdict_follows_them():
    r = tpattn.run(11, EQUIVALENCE, tolerance="auto")
    assert list(r)[-4:] == ["tolerance", "bounds", "verdict", "passed"]
    assert set(r["bounds"]) == set(tpattn.MEASURES)
    assert r["passed"] == all(r[m] <= r["bounds"][m] for m in tpattn.MEASURES)
    assert r["verdict"] == ("pass" if r["passed"] else "fail")


def test_the_bound_grows_with_the_sums_and_the_dtype():
    small, big = Config(), Config(hidden=4096, query_heads=32, kv_heads=8, head_dim=128,
                                  seq=256, world_size=8)
    assert fan_in(small) == (4 + 2 * 2) * 4 and fan_in(big) == (32 + 2 * 8) * 128
    assert relative_bound(big) > relative_bound(small)
    assert relative_bound(Config(dtype="float64")) < relative_bound(small) < relative_bound(
        Config(dtype="bfloat16"))
    u = UNIT_ROUNDOFF["float32"]
    assert relative_bound(small) == pytest.approx(u * (math.sqrt(32) + 2 + 4))


def test_bfloat16_matmuls_accumulate_in_float32():
    # The bound's u_acc for bfloat16 is float32's: summed in bf16, 4096 ones would stop at
    # 256 (256 + 1 rounds back to 256 with 8 significand bits); a float32 accumulator gets 4096.
    ones = torch.ones(1, 4096, dtype=torch.bfloat16)
    assert torch.tensor(256.0, dtype=torch.bfloat16) + 1 == 256
    assert (ones @ ones.T).item() == 4096


def test_low_precision_dense_is_within_its_bound_of_float64():
    for dtype in ("float32", "bfloat16"):
        row = against_float64(Config(dtype=dtype, seq=8, hidden=64, query_heads=8,
                                     kv_heads=4, head_dim=16, world_size=4), 5, init="fan_in")
        assert row["passed"], row


def test_bad_tolerance_and_init_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match=r"tolerance must be one of seed, auto \(got 'x'\)"):
        check_tolerance("x")
    with pytest.raises(ValueError, match="tolerance must be one of"):
        tpattn.run(11, EQUIVALENCE, tolerance="loose")
    with pytest.raises(ValueError, match=r"init must be one of seed, fan_in"):
        init_params(Config(), 1, init="xavier")


def test_cli_tolerance_flag(capsys):
    assert main(["--tolerance", "auto", "--dtype", "bfloat16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and out["tolerance"] == "auto"
    with pytest.raises(SystemExit) as e:
        main(["--tolerance", "nope"])
    assert e.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_fan_in_init_scales_the_same_draws():
    a, b = init_params(Config(), 7), init_params(Config(), 7, init="fan_in")
    for k in ("wq", "wk", "wv"):
        torch.testing.assert_close(b[k], a[k] / 0.15 / 16 ** 0.5)
    torch.testing.assert_close(b["wo"], a["wo"] / 0.15 / (4 * 4) ** 0.5)  # Hq * D = 16


@pytest.mark.skipif(not SWEEP.exists(), reason="bench/tolerance_sweep.py not run")
def test_the_committed_llama_shape_sweep_separates_rounding_from_bugs():
    data = json.loads(SWEEP.read_text())
    rows = data["tp_vs_dense"]
    assert {"float32", "float64"} <= {r["dtype"] for r in rows}
    for r in rows:
        worst = max(r["ratios"].values())
        if r["mode"] == EQUIVALENCE:
            assert r["passed"] and worst <= 1, r
        else:
            assert not r["passed"]
            assert worst >= (BF16_MARGIN if r["dtype"] == "bfloat16" else MARGIN), r


def test_verdicts_pass_inconclusive_fail_and_the_probe_runs_only_when_needed():
    from tpattn.check.tolerance import apply_auto
    bounds = {m: 1.0 for m in tpattn.MEASURES}
    amp = {m: 50.0 for m in tpattn.MEASURES[:4]}
    floors = {m: 50.0 for m in tpattn.MEASURES}
    calls = []

    def probe():
        calls.append(1)
        return floors, amp

    within = dict({m: 0.5 for m in tpattn.MEASURES}, seed=1, mode=EQUIVALENCE)
    assert apply_auto(within, bounds, probe)["verdict"] == "pass" and not calls
    amplified = dict(within, input_grad_max_abs_diff=20.0)
    r = apply_auto(amplified, bounds, probe)
    assert calls and r["verdict"] == "inconclusive" and not r["passed"]
    assert r["reason"].startswith("rounding is amplified ~50x") and r["amplification"] == 50
    assert apply_auto(dict(within, forward_max_abs_diff=60.0), bounds, probe)["verdict"] == "fail"
    assert apply_auto(amplified, bounds)["verdict"] == "fail"  # no probe: the bound alone


def test_reduced_precision_float32_matmuls_are_refused():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        with pytest.raises(ValueError, match="get_float32_matmul_precision"):
            tpattn.run(11, EQUIVALENCE, tolerance="auto")
        assert tpattn.run(11, EQUIVALENCE)["passed"]  # the seed's check does not model kernels
    finally:
        torch.set_float32_matmul_precision(before)


def test_cli_init_flag(capsys):
    assert main(["--tolerance", "auto", "--init", "fan_in"]) == 0
    fan = json.loads(capsys.readouterr().out)
    assert main(["--tolerance", "auto"]) == 0
    seed = json.loads(capsys.readouterr().out)
    assert fan["verdict"] == seed["verdict"] == "pass"
    assert fan["forward_max_abs_diff"] != seed["forward_max_abs_diff"] or \
        fan["bounds"] != seed["bounds"]
    with pytest.raises(SystemExit) as e:
        main(["--init", "xavier"])
    assert e.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
