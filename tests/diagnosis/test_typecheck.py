"""Tier 0 (``tpattn.diagnosis.typecheck``): the per-rank blocks under spmd_types' type checker.

Correct TP type-checks at every shape and variant the real-rank tests use (plain, SP, KV
replicas in both strategies, float64/bfloat16); every registry mode has a verdict; the missing
f and g are caught with messages that name the tensors; the fake process group is set up and
torn down cleanly; the CLI prints JSON and exits 0; ``import tpattn`` does not load spmd_types.
Held out from the verdict table (tuned at ``TABLE_SETUPS``, W=2 mostly): the same verdicts at
W=4 and at another seed. Nothing here compares numbers: types do not depend on values.
"""
import json
import subprocess
import sys

import pytest
import torch.distributed as dist

from tpattn import Config, EQUIVALENCE, MISSING_INPUT_GRAD_REDUCE, MISSING_OUTPUT_REDUCE
from tpattn.check.core import MISSING_KV_GRAD_REDUCE
from tpattn.cli import main as cli_main
from tpattn.bugs.zoo import MESH_NEEDS
from tpattn.diagnosis.typecheck import TABLE_SETUPS, TYPECHECK_VERDICTS, WHY, typecheck, typecheck_table
from tpattn.bugs.zoo import REGISTRY

#: The correct variants of the other tests' shapes (test_distributed, test_sequence_parallel,
#: test_kv_heads, test_zoo).
CORRECT = [
    Config(), Config(world_size=1), Config(dtype="float64"), Config(dtype="bfloat16"),
    Config(query_heads=8, kv_heads=4), Config(query_heads=8, kv_heads=4, world_size=4),
    Config(seq=8, sequence_parallel=True),
    Config(seq=8, query_heads=8, kv_heads=4, world_size=4, sequence_parallel=True),
    Config(seq=8, sequence_parallel=True, dtype="bfloat16"),
    *[Config(query_heads=q, kv_heads=k, world_size=w, kv_strategy=s)
      for q, k, w in ((8, 2, 4), (8, 1, 4), (16, 2, 8))
      for s in ("replicate_weights", "gather_activations")],
    Config(query_heads=8, kv_heads=2, world_size=4, dtype="bfloat16"),
]

#: What the checker says of each registry mode at its TABLE_SETUPS setup.
EXPECTED = {
    EQUIVALENCE: "type-checks",
    MISSING_OUTPUT_REDUCE: "caught",
    MISSING_INPUT_GRAD_REDUCE: "caught",
    "input_grad_reduce_averaged": "not a type error",
    "input_grad_reduced_twice": "caught",
    "output_reduced_twice": "caught",
    "grad_norm_counts_replicas": "not a type error",
    "row_bias_on_every_rank": "caught",
    "fused_qkv_naive_split": "not a type error",
    "repeat_kv_tiled": "not a type error",
    "qkv_loaded_from_rank0": "not a type error",
    "grouped_qkv_read_as_plain": "not a type error",
    "inputs_not_replicated": "not a type error",
    "missing_norm_grad_reduce": "caught",
    "norm_grad_averaged": "not a type error",
    MISSING_KV_GRAD_REDUCE: "caught",
    "dropout_rng_desync": "not a type error",
    "qk_norm_grad_not_reduced": "caught",
}

#: The block's line each caught mode is raised at (it names the tensors that do not mix).
WHERE = {
    MISSING_OUTPUT_REDUCE: "engine.rank_block: return x + prog.add_bias(out, p)",
    MISSING_INPUT_GRAD_REDUCE: 'engine.attend: q = _heads(_project(n, p["wq"]), d)',
    "input_grad_reduced_twice": "engine.rank_block: n = prog.f(n, comm)",
    "output_reduced_twice": "engine.rank_block: out = prog.g(partials, comm)",
    "row_bias_on_every_rank": 'wrong.bias_before_g: return partial + p["bias"]',
    "missing_norm_grad_reduce": "rms_norm: return x * torch.rsqrt(",
    MISSING_KV_GRAD_REDUCE: "engine._kv: return _project(n, wk), _project(n, wv)",
    "qk_norm_grad_not_reduced": "engine.head_norm: return rms_norm(",
}


@pytest.fixture(scope="module")
def table():
    return {row["mode"]: row for row in typecheck_table()}


@pytest.mark.parametrize("cfg", CORRECT, ids=str)
def test_correct_tp_type_checks_at_every_tested_shape_and_variant(cfg):
    result = typecheck(EQUIVALENCE, cfg)
    assert result["verdict"] == "type-checks", result["message"]
    assert result["message"] is None and result["where"] is None
    assert not dist.is_initialized()


def test_every_registry_mode_has_its_verdict_and_a_reason(table):
    mesh = {n for n, m in REGISTRY.items() if set(m.needs) & set(MESH_NEEDS)}
    assert list(table) == [m for m in REGISTRY if m not in mesh]  # listing order
    assert set(EXPECTED) == set(REGISTRY) - mesh
    for mode, row in table.items():
        assert row["verdict"] == EXPECTED[mode], (mode, row["message"])
        assert row["verdict"] in TYPECHECK_VERDICTS
        assert row["why"] == WHY[mode][row["verdict"]]
        if row["verdict"] == "caught":
            assert WHERE[mode] in row["where"], (mode, row["where"])
            assert row["message"]
        else:
            assert row["message"] is None and row["where"] is None


@pytest.mark.parametrize("mode", [m for m in EXPECTED if m not in TABLE_SETUPS])
def test_the_verdicts_hold_at_four_ranks_and_another_seed(mode):
    """Held out: the table is made at W=2 and seed 11."""
    cfg = Config(query_heads=8, kv_heads=4, world_size=4)
    result = typecheck(mode, cfg, seed=29)
    assert result["verdict"] == EXPECTED[mode], result["message"]
    if mode in WHERE:
        assert WHERE[mode] in result["where"]


def test_held_out_setups_of_the_sp_and_kv_modes():
    sp4 = Config(seq=8, query_heads=8, kv_heads=4, world_size=4, sequence_parallel=True)
    assert typecheck("missing_norm_grad_reduce", sp4)["verdict"] == "caught"
    assert typecheck("norm_grad_averaged", sp4)["verdict"] == "not a type error"
    for cfg in (Config(query_heads=8, kv_heads=1, world_size=4),
                Config(query_heads=16, kv_heads=2, world_size=8)):
        result = typecheck(MISSING_KV_GRAD_REDUCE, cfg)
        assert result["verdict"] == "caught" and WHERE[MISSING_KV_GRAD_REDUCE] in result["where"]
    assert typecheck("repeat_kv_tiled", Config(query_heads=16, kv_heads=8, world_size=4),
                     seed=17)["verdict"] == "not a type error"


def test_missing_f_names_the_tensors_and_the_rule():
    result = typecheck(MISSING_INPUT_GRAD_REDUCE)
    message = result["message"]
    assert message.startswith("Invariant type on axis")
    assert "cannot mix with other types. Found types: [I, V]" in message
    assert "src=I, dst=R" in message  # the fix: f, convert I -> R
    assert '_project(n, p["wq"])' in result["where"]  # n (invariant) meets wq (varying)


def test_missing_g_is_raised_at_the_residual_add_and_its_hint_names_fs_fix():
    result = typecheck(MISSING_OUTPUT_REDUCE)
    assert result["where"] == ("tpattn.parallel.engine.rank_block: "
                               "return x + prog.add_bias(out, p)")
    assert "cannot mix with other types. Found types: [I, V]" in result["message"]
    # the hint suggests f's convert on the invariant operand (x), not the missing all-reduce
    assert "src=I, dst=R" in result["message"] and "all_reduce" not in result["message"]


def test_sp_missing_reduce_scatter_is_missed_but_missing_all_gather_grad_is_caught():
    sp = Config(seq=8, sequence_parallel=True)
    assert typecheck(MISSING_OUTPUT_REDUCE, sp)["verdict"] == "missed"
    assert typecheck(MISSING_OUTPUT_REDUCE, sp)["why"] == WHY[MISSING_OUTPUT_REDUCE]["missed"]
    caught = typecheck(MISSING_INPUT_GRAD_REDUCE, sp)
    assert caught["verdict"] == "caught" and '_project(n, p["wq"])' in caught["where"]


def test_the_fake_group_is_torn_down_and_a_real_one_is_left_alone(tmp_path):
    for _ in range(2):  # twice in one process, a caught bug in between
        assert typecheck(MISSING_OUTPUT_REDUCE)["verdict"] == "caught"
        assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already initialized"):
            typecheck(EQUIVALENCE)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode, cfg, message", [
    ("no_such_mode", Config(), "mode"),
    (MISSING_KV_GRAD_REDUCE, Config(), "kv_heads < world_size"),
    ("missing_norm_grad_reduce", Config(), "sequence_parallel"),
    ("row_bias_on_every_rank", Config(query_heads=8, kv_heads=2, world_size=4),
     "kv_heads must be >= world_size"),
    ("output_reduced_twice", Config(seq=8, sequence_parallel=True), "sequence_parallel must be False"),
])
def test_a_mode_the_setup_cannot_run_is_a_value_error(mode, cfg, message):
    with pytest.raises(ValueError, match=message):
        typecheck(mode, cfg)
    assert not dist.is_initialized()


def test_cli_prints_the_verdict_as_json_and_exits_0(capsys):
    assert cli_main(["--mode", MISSING_INPUT_GRAD_REDUCE, "--typecheck"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "caught" and '_project(n, p["wq"])' in out["where"]
    assert cli_main(["--mode", EQUIVALENCE, "--typecheck", "--world-size", "4",
                     "--query-heads", "8", "--kv-heads", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "type-checks"


@pytest.mark.parametrize("argv", [
    ["--mode", "matrix", "--typecheck"], ["--mode", "inspect", "--typecheck"],
    ["--typecheck", "--diagnose"], ["--mode", MISSING_KV_GRAD_REDUCE, "--typecheck"]])
def test_cli_bad_combinations_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err


def test_import_tpattn_does_not_import_spmd_types():
    code = ("import tpattn, tpattn.real.ranks, tpattn.cli, sys\n"
            "print('spmd_types' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_diagnose_says_where_it_used_tier_0_and_changes_nothing_else():
    from tpattn import diagnose
    from tpattn.diagnosis.observe import observe

    for mode, seed in ((MISSING_INPUT_GRAD_REDUCE, 3), ("fused_qkv_naive_split", 5)):
        obs = observe(mode, seed, Config())
        plain, typed = diagnose(obs), diagnose(obs, tier0=True)
        assert [{k: v for k, v in c.items() if k != "tier0"} for c in typed] == plain
        first = typed[0]
        assert first["cause"] == mode and first["tier0"]["used"]
        assert first["tier0"]["verdict"] == EXPECTED[mode]
    good = diagnose(observe(EQUIVALENCE, 3, Config()), tier0=True)
    assert all("tier0" not in c for c in good)  # "no known cause": no static verdict applies


def test_following_the_row_bias_hint_type_checks_with_the_bias_still_before_g():
    """WHY's claim: convert(bias, I->R), the checker's hint, silences it; g then sums W biases."""
    import torch
    from spmd_types import I, P, R, V, all_reduce, assert_type, convert
    from spmd_types.checker import typecheck as spmd_typecheck

    dist.init_process_group(backend="fake", rank=0, world_size=2)
    try:
        tp = dist.group.WORLD
        partial, bias = torch.randn(3, 4), torch.randn(4)
        with spmd_typecheck():
            assert_type(partial, {tp: V})
            assert_type(bias, {tp: I})
            out = all_reduce(partial + convert(bias, tp, src=I, dst=R), tp, src=P, dst=I)
            assert_type(out, {tp: I})  # well-typed, and the bias went into the sum on each rank
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", [n for n, m in REGISTRY.items()
                                  if not set(m.needs) & set(MESH_NEEDS)])
def test_every_modes_bug_free_twin_type_checks(mode):
    """The correct version of each setup (bias after g, fused QKV cut by heads, clipping, SP,
    KV replicas) type-checks: a caught verdict is the bug's, not the setup's."""
    result = typecheck(mode, TABLE_SETUPS.get(mode, Config()), twin=True)
    assert result["verdict"] == "type-checks", result["message"]


@pytest.mark.parametrize("mode,cfg", [("dp_grad_group_of_one", Config(data_parallel=2)),
                                      ("equivalence", Config(data_parallel=2))])
def test_the_mesh_is_not_type_checked(mode, cfg):
    with pytest.raises(ValueError, match="typecheck checks one TP group"):
        typecheck(mode, cfg)
