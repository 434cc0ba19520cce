"""Sequence parallelism (``Config.sequence_parallel``, ``tpattn.parallel.sequence_parallel``).

Tolerances. Correct SP differs from dense only by float rounding (the order in which the rank
partials and the ranks' shares of the ``norm`` gradient are summed), ~1 ulp of the values:
float32 at the seed's scale (wo's fan-in query_heads*head_dim <= 32, |y| < 8) stays below the
verdict's 1e-6 (see tests/check/test_properties.py); float64 rounding is ~1e-16 relative, so 1e-12
holds with a wide margin at realistic sizes too. A bug's signature is asserted with a margin of
orders of magnitude: a wrong value is > 1e-4, an exact one < 1e-6 (float32, seed's scale).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpattn.bugs.zoo import REGISTRY
import tpattn
from tpattn import MEASURES, TOLERANCE, Config
from tpattn.check.core import (LR, EQUIVALENCE, MISSING_INPUT_GRAD_REDUCE, MISSING_NORM_GRAD_REDUCE,
                          MISSING_OUTPUT_REDUCE, MODES, NORM_GRAD_AVERAGED, PARAM_SEED_OFFSET,
                          SP_MODES, SP_ONLY_MODES, dense_reference, make_inputs)
from tpattn.cli import main as cli_main
from tpattn.block.layers import apply_rope
from tpattn.block.params import init_params, shard_params, unshard_params
from tpattn.parallel.collectives import (CopyToRanks, GatherKV, GatherSequence,
                                         ReduceFromRanks, ScatterSequence, SimulatedRanks)
from tpattn.parallel.simulated import rank_steps, simulated_step
from tpattn.parallel.sequence_parallel import communication_ledger, norm_activation_bytes, rank_tokens, ring_bytes

SP2 = Config(seq=8, sequence_parallel=True)
SP4 = Config(seq=8, query_heads=8, kv_heads=4, world_size=4, sequence_parallel=True)
SIMULATIONS = ("fixture", "ranks")


def worst(result) -> float:
    return max(result[m] for m in MEASURES)


@st.composite
def sp_configs(draw, dtype="float64", world_sizes=(1, 2, 4), max_fan_in=None):
    """A valid sequence-parallel Config: seq a multiple of world_size, complete KV groups."""
    w = draw(st.sampled_from(world_sizes))
    kv = w * draw(st.integers(1, 2))
    q = kv * draw(st.integers(1, 3))
    head_dims = [d for d in (2, 4, 6, 8) if max_fan_in is None or q * d <= max_fan_in] or [2]
    return Config(seq=w * draw(st.integers(1, 3)), batch=draw(st.integers(1, 3)),
                  # float32: the seed's scale (fan-in <= 16, see tests/rounding.py), and hidden >= 2:
                  # at hidden 1 RMSNorm's exact gradient is 0 but is computed as a cancellation
                  # of O(1/|x|) terms, so its float32 rounding has no absolute bound
                  hidden=draw(st.integers(2, 16) if dtype == "float32" else st.integers(1, 24)),
                  query_heads=q, kv_heads=kv,
                  head_dim=draw(st.sampled_from(head_dims)), world_size=w,
                  dtype=dtype, sequence_parallel=True)


# --- the Config rule and the modes --------------------------------------------------------

def test_seq_must_divide_by_world_size():
    with pytest.raises(ValueError, match=r"seq must be a multiple of world_size under "
                                         r"sequence_parallel.*seq=5, world_size=2"):
        Config(sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel must be True or False"):
        Config(seq=4, sequence_parallel="yes")
    assert Config(seq=8, world_size=4, kv_heads=4, query_heads=4, sequence_parallel=True).local_seq == 2
    assert Config().local_seq == 5  # without SP every rank holds the whole sequence


@pytest.mark.parametrize("mode", SP_ONLY_MODES)
def test_sp_only_modes_need_sequence_parallel(mode, capsys):
    with pytest.raises(ValueError, match=f"mode {mode} needs sequence_parallel=True"):
        tpattn.run(11, mode)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--mode", mode])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "--sequence-parallel" in err


def test_default_inspect_has_no_sequence_parallel_key():
    assert "sequence_parallel" not in tpattn.inspect_fixture()["config"]
    assert tpattn.inspect_fixture(SP2)["config"]["sequence_parallel"] is True


def test_matrix_modes():
    assert tpattn.bugs.modes.modes_for(Config()) == MODES  # the seed's three
    assert tpattn.bugs.modes.modes_for(SP2) == SP_MODES == MODES + SP_ONLY_MODES


# --- equivalence ----------------------------------------------------------------------------

@given(cfg=sp_configs(), seed=st.integers(0, 2**32), simulate=st.sampled_from(SIMULATIONS))
@settings(max_examples=40, deadline=None)
def test_sp_equals_dense_float64(cfg, seed, simulate):
    assert worst(tpattn.run(seed, EQUIVALENCE, cfg, simulate)) < 1e-12


@given(cfg=sp_configs(dtype="float32", max_fan_in=16), seed=st.integers(0, 2**32),
       simulate=st.sampled_from(SIMULATIONS))
@settings(max_examples=40, deadline=None)
def test_sp_equals_dense_float32_at_seed_scale(cfg, seed, simulate):
    result = tpattn.run(seed, EQUIVALENCE, cfg, simulate)
    assert result["passed"] and worst(result) < 1e-6, result


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sp_equals_dense_float64_realistic(world_size):
    cfg = Config(seq=16, batch=2, hidden=256, query_heads=8, kv_heads=4, head_dim=32,
                 world_size=world_size, dtype="float64", sequence_parallel=True)
    for simulate in SIMULATIONS:
        assert worst(tpattn.run(5, EQUIVALENCE, cfg, simulate)) < 1e-12


@pytest.mark.parametrize("mode", MODES)
def test_fixture_view_of_sp_is_the_tp_fixture(mode):
    """Documented in tpattn.parallel.sequence_parallel: one graph, the seed's three modes, same numbers."""
    for seed in (11, 17):
        sp, tp = tpattn.run(seed, mode, SP2), tpattn.run(seed, mode, Config(seq=8))
        assert sp["passed"] == tp["passed"] == (mode == EQUIVALENCE)
        assert all(abs(sp[m] - tp[m]) <= TOLERANCE for m in MEASURES)


def test_collectives_have_the_right_backward():
    comm = SimulatedRanks(Config(seq=6, query_heads=6, kv_heads=3, world_size=3,
                                 sequence_parallel=True))
    chunks = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True)  # [R, S/W, ...]
    assert torch.autograd.gradcheck(lambda t: GatherSequence.apply(t, comm), (chunks,))
    partials = torch.randn(3, 6, 3, dtype=torch.float64, requires_grad=True)  # [R, S, ...]
    assert torch.autograd.gradcheck(lambda t: ScatterSequence.apply(t, comm), (partials,))
    local = torch.randn(3, 2, 1, 2, dtype=torch.float64, requires_grad=True)  # [R, S, B, c]
    assert torch.autograd.gradcheck(lambda t: GatherKV.apply(t, comm), (local,))
    n = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True)
    dn = torch.randn(3, 2, 3, dtype=torch.float64)
    CopyToRanks.apply(n, comm).backward(dn)  # f's backward is g's forward, and back
    assert torch.equal(n.grad, ReduceFromRanks.apply(dn, comm))
    assert torch.equal(torch.autograd.grad(ReduceFromRanks.apply(n, comm), n, dn)[0], dn)


def test_rope_needs_global_positions():
    q = torch.randn(8, 2, 3, 4)
    full = apply_rope(q)
    assert torch.equal(apply_rope(q, offset=0), full)  # the default is unchanged
    for r, tokens in enumerate([rank_tokens(SP4, r) for r in range(4)]):
        assert torch.allclose(apply_rope(q[tokens], offset=tokens.start), full[tokens], atol=1e-6)
        if r:  # local positions 0..S/W-1 rotate rank r's tokens by the wrong angles
            assert (apply_rope(q[tokens]) - full[tokens]).abs().max() > 1e-2


# --- the bugs -------------------------------------------------------------------------------

def _sp_steps(cfg, seed, mode):
    x0, target = make_inputs(cfg, seed)
    base = init_params(cfg, seed + PARAM_SEED_OFFSET)
    w = cfg.world_size
    steps = rank_steps(simulated_step(shard_params(base, cfg),
                                      list(zip(x0.chunk(w), target.chunk(w))), cfg,
                                      REGISTRY[mode].injection, LR))
    return steps, dense_reference(x0, target, base, cfg)


@pytest.mark.parametrize("cfg", [SP2, SP4], ids=["2 ranks", "4 ranks"])
@pytest.mark.parametrize("simulate", SIMULATIONS)
def test_missing_norm_grad_reduce_signature(cfg, simulate):
    for seed in (11, 17, 23):
        r = tpattn.run(seed, MISSING_NORM_GRAD_REDUCE, cfg, simulate)
        assert not r["passed"]
        for m in ("forward_max_abs_diff", "loss_abs_diff", "input_grad_max_abs_diff"):
            assert r[m] < TOLERANCE, m
        assert r["parameter_grad_max_abs_diff"] > 1e-4
    steps, dense = _sp_steps(cfg, 11, MISSING_NORM_GRAD_REDUCE)
    norm_grads = [s["grads"]["norm"] for s in steps]
    for name in ("wq", "wk", "wv", "wo"):  # the sharded weights' gradients are exact
        full = unshard_params([s["grads"] for s in steps], cfg)[name]
        assert (full - dense["grads"][name]).abs().max() < TOLERANCE
    for i in range(len(steps)):  # every rank's norm gradient is wrong, and its own
        assert (norm_grads[i] - dense["grads"]["norm"]).abs().max() > 1e-4
        for j in range(i):
            assert (norm_grads[i] - norm_grads[j]).abs().max() > 1e-4
            weights_i, weights_j = steps[i]["weights"]["norm"], steps[j]["weights"]["norm"]
            assert (weights_i - weights_j).abs().max() > 1e-6  # the replicas have diverged
    # the ranks' partial sums add up to the truth: the missing piece is the all-reduce
    assert (sum(norm_grads) - dense["grads"]["norm"]).abs().max() < TOLERANCE


@pytest.mark.parametrize("cfg", [SP2, SP4], ids=["2 ranks", "4 ranks"])
@pytest.mark.parametrize("simulate", SIMULATIONS)
def test_norm_grad_averaged_is_one_over_w(cfg, simulate):
    for seed in (11, 17, 23):
        r = tpattn.run(seed, NORM_GRAD_AVERAGED, cfg, simulate)
        assert not r["passed"] and r["parameter_grad_max_abs_diff"] > 1e-4
        assert max(r[m] for m in MEASURES[:3]) < TOLERANCE
    steps, dense = _sp_steps(cfg, 11, NORM_GRAD_AVERAGED)
    for s in steps:  # every rank agrees (it was all-reduced) on a gradient W times too small
        assert torch.equal(s["grads"]["norm"], steps[0]["grads"]["norm"])
        assert (s["grads"]["norm"] * cfg.world_size - dense["grads"]["norm"]).abs().max() < TOLERANCE
    assert (steps[0]["grads"]["norm"] - dense["grads"]["norm"]).abs().max() > 1e-4


@pytest.mark.parametrize("cfg", [SP2, SP4], ids=["2 ranks", "4 ranks"])
@pytest.mark.parametrize("simulate", SIMULATIONS)
def test_seed_bugs_under_sp(cfg, simulate):
    for seed in (11, 17, 23):
        out = tpattn.run(seed, MISSING_OUTPUT_REDUCE, cfg, simulate)
        assert out["forward_max_abs_diff"] > 1e-2 and not out["passed"]
        grad = tpattn.run(seed, MISSING_INPUT_GRAD_REDUCE, cfg, simulate)
        assert grad["forward_max_abs_diff"] < TOLERANCE and grad["loss_abs_diff"] < TOLERANCE
        assert grad["input_grad_max_abs_diff"] > 1e-4 and not grad["passed"]


def test_cli_sp_matrix_passes_equivalence_and_fails_every_bug(capsys):
    assert cli_main(["--sequence-parallel", "--seq", "8", "--mode", "matrix"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["mode"] for r in rows] == [m for m in SP_MODES for _ in tpattn.SEEDS]
    assert all(r["passed"] == (r["mode"] == EQUIVALENCE) for r in rows)


# --- the ledger -----------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [SP2, SP4], ids=["2 ranks", "4 ranks"])
def test_ledger_same_bytes_one_over_w_activations(cfg):
    rows = communication_ledger(cfg)
    tp = sum(r["bytes_per_rank"] for r in rows if r["variant"] == "TP")
    sp_block = sum(r["bytes_per_rank"] for r in rows if r["variant"] == "SP" and r["elements"] > cfg.hidden)
    norm_rows = [r for r in rows if r["variant"] == "SP" and r["elements"] == cfg.hidden]
    assert tp == sp_block > 0  # an all-reduce is a reduce-scatter plus an all-gather
    assert [r["collective"] for r in norm_rows] == ["all_reduce"]
    assert norm_rows[0]["bytes_per_rank"] == ring_bytes("all_reduce", cfg.hidden, cfg.world_size, 4)
    no_sp = Config(**{**cfg.as_dict(), "sequence_parallel": False})
    assert norm_activation_bytes(cfg) * cfg.world_size == norm_activation_bytes(no_sp)


# --- real ranks -----------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[SP2, SP4], ids=["2 ranks", "4 ranks"])
def real(request):
    from tpattn.real.ranks import run_distributed

    cfg = request.param
    return cfg, run_distributed(cfg.world_size, [11, 17], SP_MODES, cfg, dtensor=[11])


def test_real_ranks_equal_simulated_ranks(real):
    cfg, report = real
    simulated = tpattn.run_matrix([11, 17], SP_MODES, cfg, "ranks")
    assert [(r["mode"], r["seed"], r["passed"]) for r in report.results] == \
        [(s["mode"], s["seed"], s["passed"]) for s in simulated]
    for r, s in zip(report.results, simulated):
        assert all(abs(r[m] - s[m]) <= TOLERANCE for m in MEASURES), (r, s)


def test_real_ranks_disagree_only_without_the_norm_all_reduce(real):
    cfg, report = real
    for row in report.rank_disagreement:
        if row["mode"] == MISSING_NORM_GRAD_REDUCE:
            assert row["norm_grad_max_rank_diff"] > 1e-4 and row["norm_after_step_max_rank_diff"] > 1e-6
            by_rank = torch.tensor(row["norm_grad_by_rank"])
            assert len({tuple(g) for g in by_rank.tolist()}) == cfg.world_size  # all different
        else:
            assert row["norm_grad_max_rank_diff"] == row["norm_after_step_max_rank_diff"] == 0


def test_real_ledger_counts_the_plan(real):
    cfg, report = real
    ours = {row["mode"]: row for row in report.ledger if row["variant"] == "tpattn SP"}
    expected = sum(r["bytes_per_rank"] for r in communication_ledger(cfg) if r["variant"] == "SP")
    assert ours[EQUIVALENCE]["bytes_per_rank"] == expected
    assert {k: v for k, v in ours[EQUIVALENCE].items() if k.startswith(("forward", "backward", "after"))} == {
        "forward all_gather": 1, "forward reduce_scatter": 1, "backward all_gather": 1,
        "backward reduce_scatter": 1, "after backward all_reduce": 1}
    assert "after backward all_reduce" not in ours[MISSING_NORM_GRAD_REDUCE]
    assert "forward reduce_scatter" not in ours[MISSING_OUTPUT_REDUCE]
    assert "backward reduce_scatter" not in ours[MISSING_INPUT_GRAD_REDUCE]
    assert ours[NORM_GRAD_AVERAGED] == {**ours[EQUIVALENCE], "mode": NORM_GRAD_AVERAGED}


def test_dtensor_sp_passes_and_reduces_the_norm_grad_itself(real):
    cfg, report = real
    (dtensor,) = report.dtensor
    ours = next(r for r in report.results if r["mode"] == EQUIVALENCE and r["seed"] == 11)
    assert dtensor["passed"] and all(abs(dtensor[m] - ours[m]) <= TOLERANCE for m in MEASURES)
    row = next(r for r in report.ledger if r["variant"] == "DTensor SequenceParallel")
    assert row["norm_grad_placement"] == "P(sum)"  # partial sums after backward ...
    assert row["SGD step all_reduce"] == 1  # ... that DTensor all-reduces in the step
    assert row["forward reduce_scatter"] == 1 and row["backward all_gather"] == 1


def test_torchrun_sp_matrix_equals_simulated_ranks():
    root = pathlib.Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    flags = ["--sequence-parallel", "--seq", "8", "--mode", "matrix", "--seeds", "11", "17"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "tpattn.distributed", *flags]
    real = json.loads(subprocess.run(torchrun, capture_output=True, text=True, env=env, check=True,
                                     cwd=root, timeout=180).stdout)
    simulated = tpattn.run_matrix([11, 17], SP_MODES, SP2, "ranks")
    assert [(r["mode"], r["seed"], r["passed"]) for r in real] == \
        [(s["mode"], s["seed"], s["passed"]) for s in simulated]
    assert all(abs(r[m] - s[m]) <= TOLERANCE for r, s in zip(real, simulated) for m in MEASURES)


# --- figures and the explorer ---------------------------------------------------------------

def test_norm_grad_figure_and_ledger_figure():
    import matplotlib.pyplot as plt

    from tpattn import viz

    fig = viz.norm_grad_by_rank_figure([[1.0, 2.0], [0.5, -1.0]], [1.5, 1.0])
    (ax,) = fig.axes
    assert len(ax.lines) == 1 + 2 + 1 + 1  # truth, two ranks, their sum, the zero line
    with pytest.raises(ValueError, match="one gradient of length 2 per rank"):
        viz.norm_grad_by_rank_figure([[1.0]], [1.0, 2.0])
    ledger_fig = viz.sp_ledger_figure(communication_ledger(SP2))
    assert [t.get_text() for t in ledger_fig.axes[0].get_yticklabels()] == ["TP", "SP"]
    plt.close("all")


def test_sp_explorer_switches_mode_and_never_shows_a_traceback():
    from tpattn import widgets

    explorer = widgets.sp_explorer()
    text = lambda: "\n".join(o["data"]["text/plain"] for o in explorer.output.outputs)  # noqa: E731
    assert "PASSED" in text()
    explorer.set(mode=MISSING_NORM_GRAD_REDUCE)
    assert "FAILED" in text() and MISSING_NORM_GRAD_REDUCE in text()
    explorer.set(seed=-1)
    (output,) = explorer.output.outputs
    assert "seed must be an integer" in output["data"]["text/plain"]
    assert "Traceback" not in output["data"]["text/plain"]
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        widgets.sp_explorer(cfg=Config())


def test_run_distributed_validates_sp_input():
    from tpattn.real.ranks import run_distributed

    with pytest.raises(ValueError, match="fault injection is not supported"):
        run_distributed(2, [11], [EQUIVALENCE], SP2, fault={"rank": 1, "kind": "raise"})
    with pytest.raises(ValueError, match="needs sequence_parallel=True"):
        run_distributed(2, [11], [MISSING_NORM_GRAD_REDUCE], Config(seq=8))
