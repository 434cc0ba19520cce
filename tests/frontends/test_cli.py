"""The CLI: end to end in subprocesses (the seed's JSON, Config flags, --strict, one error of
each kind), and every bad input in-process through the same `main` (each subprocess pays
~2 s of `import torch`)."""
import json
import pathlib
import subprocess
import sys

import pytest

import tpattn
from tpattn.cli import main

from tests.conftest import ROOT, load_golden

# A shape where correct TP differs from dense by 8.6e-6 .. 1.4e-5 in float32 (measured over seeds
# 0..7 under the kernel settings of `make test-portable`): outputs reach ~18, where one
# float32 step is 1.9e-6, and each rank's wo shard sums 18 terms (3 heads of 6 channels), not a
# multiple of any SIMD width, so a BLAS's blocking of the dense 144-term sum is not expected to
# reproduce the ranks' order (with 2 ranks of 256 terms at hidden 512 it did, on an AVX-512
# Xeon: forward difference 0.0). Far above the
# seed's absolute 1e-6, so `equivalence` reports passed=false on every machine; float64 passes.
BIG = ["--seq", "16", "--hidden", "256", "--query-heads", "24", "--kv-heads", "8",
       "--head-dim", "6", "--world-size", "8", "--seed", "1"]

INVOCATIONS = {
    "matrix": ["--mode", "matrix"],
    "inspect": ["--mode", "inspect"],
    "default": [],
    "missing_f_seed_17": ["--mode", "missing_input_grad_reduce", "--seed", "17"],
    "shape_f64": ["--mode", "matrix", "--seeds", "3", "4", "--dtype", "float64", "--seq", "3",
                  "--query-heads", "8", "--kv-heads", "4", "--world-size", "4"],
    "strict_fail": BIG + ["--strict"],
    "strict_ok": BIG + ["--strict", "--dtype", "float64"],
    "strict_bug_mode": ["--strict", "--mode", "missing_output_reduce"],
    "bad_mode": ["--mode", "nope"],  # an argparse error
    "bad_kv": ["--kv-heads", "3"],  # a Config error
}

BAD_INPUT = [
    (["--mode", "nope"], "--mode: invalid choice: 'nope'"),
    (["--seed", "x"], "--seed: invalid int value: 'x'"),
    (["--seed", "-1"], "seed must be an integer in [0,"),
    (["--mode", "matrix", "--seeds", "1", "-5"], "seed must be an integer in [0,"),
    (["--kv-heads", "3"], "query_heads must be a multiple of kv_heads"),
    (["--world-size", "0"], "world_size must be an integer >= 1"),
    (["--world-size", "3"], "world_size must be a multiple of kv_heads when kv_heads < world_size"),
    (["--world-size", "8"], "query_heads must be a multiple of world_size when kv_heads < world_size"),
    (["--kv-heads", "4", "--world-size", "3", "--query-heads", "12"],
     "kv_heads must be a multiple of world_size when kv_heads >= world_size"),
    (["--mode", "missing_kv_grad_reduce"], "mode missing_kv_grad_reduce needs replicated KV heads"),
    (["--kv-strategy", "x"], "--kv-strategy: invalid choice: 'x'"),
    (["--head-dim", "3"], "head_dim must be even"),
    (["--eps", "-1"], "eps must be a finite number > 0"),
    (["--eps", "nan"], "eps must be a finite number > 0"),
    (["--dtype", "float16"], "--dtype: invalid choice: 'float16'"),
    (["--mode", "matrix", "--seeds"], "--seeds: expected at least one argument"),
    (["--heads", "4"], "unrecognized arguments: --heads 4"),
]


@pytest.fixture(scope="module")
def cli():
    """Run every invocation once, concurrently (each pays ~2 s of `import torch`)."""
    procs = {name: subprocess.Popen([sys.executable, "-m", "tpattn", *args], cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, args in INVOCATIONS.items()}
    return {name: (p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for name, p in procs.items()}


def test_matrix_prints_the_golden_json_and_equals_the_api_bit_for_bit(cli):
    code, out, err = cli["matrix"]
    assert code == 0 and err == ""
    got = json.loads(out)
    assert out == json.dumps(tpattn.run_matrix(), indent=2) + "\n"  # same machine: same bits
    golden = load_golden("matrix")
    assert [(r["mode"], r["seed"], r["passed"]) for r in got] == \
           [(r["mode"], r["seed"], r["passed"]) for r in golden]


def test_inspect_and_single_runs(cli):
    code, out, _ = cli["inspect"]
    assert code == 0 and json.loads(out)["config"] == load_golden("inspect")["config"]
    code, out, _ = cli["default"]
    assert code == 0 and out == json.dumps(tpattn.run(11, "equivalence"), indent=2) + "\n"
    code, out, _ = cli["missing_f_seed_17"]
    assert code == 0 and out == json.dumps(tpattn.run(17, "missing_input_grad_reduce"), indent=2) + "\n"


def test_config_flags_reach_the_run(cli):
    code, out, _ = cli["shape_f64"]
    cfg = tpattn.Config(seq=3, query_heads=8, kv_heads=4, world_size=4, dtype="float64")
    assert code == 0 and json.loads(out) == tpattn.run_matrix([3, 4], tpattn.MODES, cfg)


def test_strict_exits_1_only_when_an_equivalence_run_fails(cli):
    code, out, _ = cli["strict_fail"]
    assert code == 1 and json.loads(out)["passed"] is False  # the result is still printed
    code, out, _ = cli["strict_ok"]
    assert code == 0 and json.loads(out)["passed"] is True
    code, out, _ = cli["strict_bug_mode"]  # a failing bug mode is the expected result
    assert code == 0 and json.loads(out)["passed"] is False


@pytest.mark.parametrize("name, needle", [
    ("bad_mode", "--mode: invalid choice: 'nope'"),
    ("bad_kv", "query_heads must be a multiple of kv_heads"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_2(cli, name, needle):
    code, out, err = cli[name]
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("python -m tpattn: error: ") and needle in err, err


@pytest.mark.parametrize("argv, needle", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_every_bad_input_is_one_named_line_and_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tpattn: error: ") and needle in err, err


@pytest.mark.parametrize("typed, nearest", [
    ("missing_f", "missing_input_grad_reduce"),
    ("equivalance", "equivalence"),
    ("loss_reduced", "loss_reduced_over_world"),
])
def test_a_mistyped_mode_names_the_nearest_modes_in_one_short_line(capsys, typed, nearest):
    with pytest.raises(SystemExit) as e:
        main(["--mode", typed])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err.count("\n") == 1, err
    assert f"invalid choice: '{typed}' (nearest: " in err and nearest in err, err
    assert "--list-modes" in err and "choose from" not in err and len(err) < 200, err


def test_a_mode_near_no_other_points_at_list_modes_only(capsys):
    with pytest.raises(SystemExit):
        main(["--mode", "xyzzy_qq"])
    err = capsys.readouterr().err
    assert err == ("tpattn: error: argument --mode: invalid choice: 'xyzzy_qq' "
                   "(all of them: --list-modes)\n")


def test_console_script_is_installed():
    script = pathlib.Path(sys.executable).parent / "tpattn"
    result = subprocess.run([str(script), "--mode", "inspect"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and json.loads(result.stdout)["rule"].startswith("keep complete")
