"""``python -m tpattn --model lm`` (``tpattn.cli_lm``): ``--mode matrix`` prints every mode of
``LM_REGISTRY`` for every seed, correct TP passing and each bug failing exactly the measures its
entry names, equal bit for bit to ``run_lm``; one mode; the LM flags reach the ``LMConfig``;
``--list-modes`` prints the registry; bad input is one line naming the field, exit 2."""
import json

import pytest

from tpattn.bugs.lm_zoo import LM_EQUIVALENCE, LM_REGISTRY
from tpattn.check.measures import MEASURES
from tpattn import cli_lm
from tpattn.cli import main
from tpattn.cli_lm import lm_result, run_lm
from tpattn.config import Config
from tpattn.model.config import LMConfig


def run_cli(capsys, *argv: str) -> tuple[int, object]:
    """``main(argv)``'s exit code and its stdout parsed as JSON."""
    code = main(list(argv))
    return code, json.loads(capsys.readouterr().out)


def test_matrix_runs_every_mode_and_each_fails_its_measures(capsys):
    code, out = run_cli(capsys, "--model", "lm", "--layers", "2", "--mode", "matrix",
                        "--seeds", "11", "17")
    assert code == 0
    assert [(r["mode"], r["seed"]) for r in out] == [
        (mode, seed) for mode in LM_REGISTRY for seed in (11, 17)]
    for r in out:
        assert r["tolerance"] == "auto" and tuple(r["failed"]) == LM_REGISTRY[r["mode"]].fails
        assert r["passed"] == (r["mode"] == LM_EQUIVALENCE) == (r["verdict"] == "pass")


def test_matrix_equals_run_lm_bit_for_bit(capsys):
    code, out = run_cli(capsys, "--model", "lm", "--mode", "matrix", "--seeds", "3")
    lm = LMConfig()
    assert code == 0 and out == [run_lm(3, mode, lm) for mode in LM_REGISTRY]


def test_one_mode_and_the_default_mode(capsys):
    code, out = run_cli(capsys, "--model", "lm", "--mode", "mlp_input_grad_reduce_missing",
                        "--seed", "5")
    assert code == 0 and (out["mode"], out["seed"], out["verdict"]) == (
        "mlp_input_grad_reduce_missing", 5, "fail")
    assert out["failed"] == list(MEASURES[2:])
    code, out = run_cli(capsys, "--model", "lm")
    assert code == 0 and out["mode"] == LM_EQUIVALENCE and out["passed"] and out["failed"] == []


def test_the_lm_flags_reach_the_run(capsys):
    argv = ["--model", "lm", "--world-size", "4", "--vocab", "40", "--layers", "3", "--ffn",
            "24", "--tied", "--dtype", "float64", "--mode", "head_input_grad_reduce_missing"]
    code, out = run_cli(capsys, *argv)
    lm = LMConfig(block=Config(world_size=4, dtype="float64"), vocab=40, layers=3, ffn=24,
                  tied=True)
    assert code == 0 and out == run_lm(11, "head_input_grad_reduce_missing", lm)
    assert out != run_lm(11, "head_input_grad_reduce_missing", LMConfig())


def test_strict_exits_1_only_when_correct_tp_fails(capsys, monkeypatch):
    assert main(["--model", "lm", "--mode", "embed_reduce_missing", "--strict"]) == 0
    assert main(["--model", "lm", "--strict"]) == 0
    failing = {**run_lm(11, LM_EQUIVALENCE, LMConfig()), "verdict": "fail", "passed": False}
    monkeypatch.setattr(cli_lm, "run_lm", lambda *args: failing)
    assert main(["--model", "lm", "--strict"]) == 1
    assert main(["--model", "lm"]) == 0


def test_diagnose_adds_the_tier1_observables(capsys):
    code, out = run_cli(capsys, "--model", "lm", "--mode", "matrix", "--seeds", "11",
                        "--diagnose")
    assert code == 0
    shown = {r["mode"]: [o["observable"] for o in r["diagnosis"]] for r in out}
    assert shown[LM_EQUIVALENCE] == []
    assert shown["mlp_input_grad_reduce_missing"] == ["replicas_differ", "ledger_short"]
    for mode in ("embed_reduce_missing", "mlp_output_reduce_missing",
                 "head_input_grad_reduce_missing"):
        assert shown[mode] == ["replicas_differ", "ledger_short"], mode


def test_list_modes_prints_the_registry(capsys):
    code, out = run_cli(capsys, "--model", "lm", "--list-modes")
    assert code == 0 and out == [m.as_dict() for m in LM_REGISTRY.values()]


def test_failed_lists_the_measures_over_their_bound():
    judged = {**{m: 1.0 for m in MEASURES}, "bounds": {m: 2.0 for m in MEASURES}}
    judged["loss_abs_diff"] = 3.0
    assert lm_result(judged)["failed"] == ["loss_abs_diff"]


BAD_INPUT = [
    (["--mode", "missing_output_reduce"], "mode must be matrix or one of the LM's modes"),
    (["--vocab", "31"], "vocab must be a multiple of block.world_size"),
    (["--world-size", "4", "--ffn", "30"], "ffn must be a multiple of block.world_size"),
    (["--layers", "0"], "layers must be an integer >= 1"),
    (["--sequence-parallel", "--seq", "4"], "block.sequence_parallel must be False"),
    (["--dp", "2"], "block.data_parallel must be 1"),
    (["--qk-norm"], "block.qk_norm must be False"),
    (["--dropout", "0.1"], "block.dropout must be 0.0"),
    (["--init", "fan_in"], "--init applies to --model block only"),
    (["--typecheck"], "--typecheck applies to --model block only"),
    (["--seed", "-1"], "seed must be an integer in [0, "),
    (["--mode", "matrix", "--seeds", "3", "-3"], "seed must be an integer in [0, "),
]


@pytest.mark.parametrize("argv, needle", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_lm_input_is_one_named_line_and_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main(["--model", "lm", *argv])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tpattn: error: ") and needle in err, err


@pytest.mark.parametrize("argv, needle", [
    (["--vocab", "64"], "--vocab applies to --model lm only"),
    (["--tied"], "--tied applies to --model lm only"),
    (["--mode", "lm_equivalence"], "is a mode of the LM: it runs with --model lm"),
])
def test_lm_input_to_the_block_is_one_named_line_and_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err.count("\n") == 1 and needle in err, err
