"""Real ranks (``tpattn.real.ranks``): the check on torch.distributed processes.

- the real-rank matrix (2 ranks, and 4 ranks on a shape whose heads divide by 4) agrees with
  ``run_matrix(simulate="ranks")`` within 1e-6 on every measure, with identical verdicts; it
  differs from the original fixture's view (``simulate="fixture"``) exactly where it must: the
  gradient measures of ``missing_output_reduce`` (each real rank trains on its own output;
  the fixture drops rank 1's);
- the collective ledger, the ranks' disagreement, the DTensor cross-check;
- ``torchrun -m tpattn.distributed`` prints ``python -m tpattn``'s JSON;
- a rank that raises, exits early or skips a collective fails the run fast, names the rank,
  and leaves no process behind; bad input exits 2 with one line.

Process start dominates the cost, so one module-scoped run per world size serves many tests.
Tolerance: 1e-6 absolute, the package's ``TOLERANCE``; at the original fixture's size float32 rounding
differences between the two ways of summing are ~1e-7 (measured: ≤ 2.4e-7).
"""
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

import tpattn
from tpattn import (MEASURES, MISSING_INPUT_GRAD_REDUCE, MISSING_OUTPUT_REDUCE, MODES, SEEDS,
                    TOLERANCE, Config)
from tpattn.check.core import LR
from tpattn.cli import main as cli_main
from tpattn.parallel.collectives import F_LABEL, G_LABEL
from tpattn.real.backend import RealRanks
from tpattn.real.ranks import RankFailure, planned_ledger, run_distributed
from tpattn.distributed import distributed_main as main

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)  # a hang is a failure, not a stuck `make test`

#: 4 ranks: 8 query heads, 4 KV heads → one complete group of 2 query heads per rank.
CFG4 = Config(query_heads=8, kv_heads=4, head_dim=4, hidden=16, world_size=4)
RUN_KEYS = list(tpattn.run().keys())


def _torchrun() -> list[str]:
    exe = pathlib.Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


#: Command lines run as subprocesses, started together with the first in-process run (each
#: one pays for `import torch`; they overlap with the forkserver's).
COMMANDS = {
    "torchrun_matrix": _torchrun() + ["--standalone", "--nproc-per-node", "2", "-m", "tpattn.distributed",
                                      "--mode", "matrix", "--seeds", "3", "8", "13", "--timeout", "60"],
    "bad_kv_heads": [sys.executable, "-m", "tpattn.distributed", "--kv-heads", "3"],
}


@pytest.fixture(scope="module")
def commands():
    """Start every command of ``COMMANDS`` now; ``commands[name]()`` waits for its result."""
    procs = {name: subprocess.Popen(argv, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE) for name, argv in COMMANDS.items()}
    results = {}

    def result(name):
        if name not in results:
            out, err = procs[name].communicate(timeout=240)
            results[name] = (procs[name].returncode, out, err)
        return results[name]

    yield {name: (lambda name=name: result(name)) for name in procs}
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def world2(commands):  # the commands run meanwhile
    """Every mode × seed of the fixture and the DTensor cross-check, on 2 real ranks."""
    return run_distributed(2)


@pytest.fixture(scope="module")
def world4(world2):  # after world2: its forkserver is warm, 4 ranks start in about a second
    return run_distributed(4, config=CFG4, dtensor=False)


@pytest.fixture(scope="module")
def simulated2():
    """The original fixture's model (rank 0's view)."""
    return tpattn.run_matrix()


@pytest.fixture(scope="module")
def simulated4():
    return tpattn.run_matrix(cfg=CFG4)


@pytest.fixture(scope="module")
def ranks2():
    """Simulated ranks that each train on their own output, as real ranks do."""
    return tpattn.run_matrix(simulate="ranks")


@pytest.fixture(scope="module")
def ranks4():
    return tpattn.run_matrix(cfg=CFG4, simulate="ranks")


def assert_matches_simulation(real: list[dict], simulated: list[dict]) -> None:
    """Same (seed, mode) rows, same verdicts, every measure within ``TOLERANCE``."""
    assert [(r["seed"], r["mode"]) for r in real] == [(s["seed"], s["mode"]) for s in simulated]
    for r, s in zip(real, simulated):
        assert list(r) == RUN_KEYS
        assert r["passed"] == s["passed"], (r["seed"], r["mode"])
        for m in MEASURES:
            assert abs(r[m] - s[m]) <= TOLERANCE, (r["seed"], r["mode"], m, r[m], s[m])


def assert_fixture_view_differs_under_missing_g(real: list[dict], fixture: list[dict]) -> None:
    """The fixture drops rank 1's output (its shard gets no gradient); real ranks each train on
    their own output. The gradient measures differ far above the tolerance."""
    runs = [(r, s) for r, s in zip(real, fixture) if r["mode"] == MISSING_OUTPUT_REDUCE]
    assert len(runs) == len(SEEDS)
    for r, s in runs:
        for m in ("forward_max_abs_diff", "loss_abs_diff"):  # rank 0's own output and loss
            assert abs(r[m] - s[m]) <= TOLERANCE
        assert abs(r["parameter_grad_max_abs_diff"] - s["parameter_grad_max_abs_diff"]) > 1e-3
        assert abs(r["input_grad_max_abs_diff"] - s["input_grad_max_abs_diff"]) > 1e-4


# --- agreement with the simulated ranks -------------------------------------------------------

def test_two_real_ranks_match_simulated_ranks(world2, ranks2):
    assert world2.backend == "gloo" and world2.world_size == 2
    assert_matches_simulation(world2.results, ranks2)


def test_two_real_ranks_differ_from_the_fixture_view_only_under_missing_g(world2, simulated2):
    assert_fixture_view_differs_under_missing_g(world2.results, simulated2)
    for r, s in zip(world2.results, simulated2):
        if r["mode"] != MISSING_OUTPUT_REDUCE:
            assert r["passed"] == s["passed"]
            assert all(abs(r[m] - s[m]) <= TOLERANCE for m in MEASURES)


def test_four_real_ranks_match_simulated_ranks(world4, ranks4):
    assert world4.world_size == 4 and world4.dtensor == []
    assert_matches_simulation(world4.results, ranks4)


def test_four_real_ranks_differ_from_the_fixture_view_under_missing_g(world4, simulated4):
    assert_fixture_view_differs_under_missing_g(world4.results, simulated4)


def test_missing_input_grad_reduce_is_bit_identical_to_simulation(world2, simulated2):
    """Without f, rank 0's view is exactly the simulation's (rank 0's dn only): same floats."""
    simulated = {(s["seed"], s["mode"]): s for s in simulated2}
    for r in world2.results:
        if r["mode"] == MISSING_INPUT_GRAD_REDUCE:
            assert r == simulated[(r["seed"], r["mode"])]


# --- what only real ranks show ----------------------------------------------------------------

def test_ledger_counts_one_all_reduce_each_way_and_each_bug_misses_one(world2):
    rows = {(row["variant"], row["mode"]): row for row in world2.ledger}
    assert list(rows) == ([("tpattn f/g", m) for m in MODES]
                          + [("DTensor parallelize_module", "equivalence")])
    missing = {}
    for mode in MODES:
        row = rows[("tpattn f/g", mode)]
        assert row["forward_expected"] == row["backward_expected"] == 1
        missing[mode] = [phase for phase in ("forward", "backward")
                         if row[f"{phase}_actual"] != row[f"{phase}_expected"]]
    assert missing == {"equivalence": [], MISSING_OUTPUT_REDUCE: ["forward"],
                       MISSING_INPUT_GRAD_REDUCE: ["backward"]}
    assert rows[("tpattn f/g", MISSING_OUTPUT_REDUCE)]["forward_actual"] == 0
    assert rows[("tpattn f/g", MISSING_INPUT_GRAD_REDUCE)]["backward_actual"] == 0
    dtensor = rows[("DTensor parallelize_module", "equivalence")]
    assert (dtensor["forward_actual"], dtensor["backward_actual"]) == (1, 3)  # one per Colwise layer


def test_rank_disagreement(world2, world4):
    for report in (world2, world4):
        by_mode = {}
        for row in report.rank_disagreement:
            by_mode.setdefault(row["mode"], []).append(row)
        for row in by_mode["equivalence"]:
            # after an all-reduce every rank holds the same bits and computes the same from them
            assert row["output_max_rank_diff"] == row["input_grad_max_rank_diff"] \
                == row["norm_grad_max_rank_diff"] == row["norm_after_step_max_rank_diff"] == 0.0
        for row in by_mode[MISSING_INPUT_GRAD_REDUCE]:  # f missing: each rank keeps its own dn
            assert row["output_max_rank_diff"] == 0.0
            assert row["input_grad_max_rank_diff"] > 1e-3 and row["norm_grad_max_rank_diff"] > 1e-3
            # the replicas of norm drift apart by the step size times the gradients' difference
            assert row["norm_after_step_max_rank_diff"] == pytest.approx(
                LR * row["norm_grad_max_rank_diff"], rel=1e-3)
        for row in by_mode[MISSING_OUTPUT_REDUCE]:  # g missing: each rank its own output
            assert row["output_max_rank_diff"] > 0.1 and row["input_grad_max_rank_diff"] > 1e-3
            assert row["norm_grad_max_rank_diff"] == row["norm_after_step_max_rank_diff"] == 0.0


def test_dtensor_cross_check_passes_equivalence(world2, simulated2):
    simulated = {s["seed"]: s for s in simulated2 if s["mode"] == "equivalence"}
    assert [r["seed"] for r in world2.dtensor] == list(SEEDS)
    for r in world2.dtensor:
        assert list(r) == RUN_KEYS and r["mode"] == "equivalence" and r["passed"]
        for m in MEASURES:
            assert r[m] < TOLERANCE and abs(r[m] - simulated[r["seed"]][m]) <= TOLERANCE


# --- the ledger's plan, without processes ---------------------------------------------------

def _labels(mode: str) -> list[str]:
    return [e["label"] for e in planned_ledger(mode, Config()) if e["phase"] != "step"]


def test_the_plan_is_the_simulated_ledger_and_drops_the_missing_reduction():
    assert _labels("equivalence") == [G_LABEL, F_LABEL]
    assert _labels(MISSING_OUTPUT_REDUCE) == [F_LABEL]
    assert _labels(MISSING_INPUT_GRAD_REDUCE) == [G_LABEL]


def test_the_ledger_names_a_skipped_collective():
    comm = RealRanks(Config(), {}, 0, planned_ledger("equivalence", Config()),
                     "seed 11 equivalence")
    plan = comm.plan
    comm.ledger = plan[:1]
    assert comm.deviation() is None  # a prefix of the plan: fine so far
    with pytest.raises(RuntimeError, match="issued 1 of the 3 planned collectives"):
        comm.check_plan()
    comm.ledger = [plan[1]]
    assert comm.deviation() == (f"it issued {F_LABEL} as collective #1 of seed 11 "
                                f"equivalence where the plan has {G_LABEL}")


# --- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 0}, "world_size must be an integer >= 1"),
    ({"world_size": 2, "config": CFG4}, "world_size must equal config.world_size"),
    ({"world_size": 2, "timeout": 0}, "timeout must be a finite number of seconds > 0"),
    ({"world_size": 2, "seeds": 11}, "seeds and modes must be sequences"),
    ({"world_size": 2, "seeds": [-1]}, "seed must be an integer in [0,"),
    ({"world_size": 2, "modes": ["nope"]}, "mode must be one of"),
    ({"world_size": 2, "fault": {"rank": 1, "kind": "nope"}}, "fault kind must be one of"),
    ({"world_size": 2, "fault": {"rank": 2, "kind": "raise"}}, "fault rank must be an integer in [0, 2)"),
    ({"world_size": 3}, "world_size must be a multiple of kv_heads when kv_heads < world_size"),
])
def test_bad_arguments_raise_value_error_naming_the_rule(kwargs, message):
    with pytest.raises(ValueError) as e:
        run_distributed(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "3"], "world_size must be a multiple of kv_heads when kv_heads < world_size"),
    (["--timeout", "0"], "timeout must be a finite number of seconds > 0"),
    (["--mode", "matrix", "--seeds", "-2"], "seed must be an integer in [0,"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err


def test_cli_under_torchrun_needs_one_process_per_rank(monkeypatch, capsys):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert main(["--world-size", "4", "--query-heads", "8", "--kv-heads", "4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert ("world_size must equal the number of processes: --world-size is 4 "
            "but torchrun started 2") in err


def test_cli_bad_input_in_a_subprocess_is_one_line(commands):
    returncode, out, err = commands["bad_kv_heads"]()
    assert returncode == 2 and out == ""
    assert err.count("\n") == 1 and "query_heads must be a multiple of kv_heads" in err


# --- torchrun ------------------------------------------------------------------------------------

def test_torchrun_prints_python_m_tpattn_json(commands, world2, capsys):
    returncode, out, err = commands["torchrun_matrix"]()
    assert returncode == 0, err[-2000:]
    assert cli_main(["--simulate", "ranks", "--mode", "matrix", "--seeds", "3", "8", "13"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    real = json.loads(out)  # rank 0 alone prints: one JSON document
    assert_matches_simulation(real, simulated)


# --- failing fast --------------------------------------------------------------------------------

def _descendants() -> set[int]:
    """PIDs of every process below this one (psutil if installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        parents = {}
        for entry in pathlib.Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        found, frontier = set(), {os.getpid()}
        while frontier:
            frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
            found |= frontier
        return found
    return {p.pid for p in psutil.Process().children(recursive=True)}


FAULT_TIMEOUT_S = 3.0


@pytest.mark.parametrize("kind, expected", [
    ("raise", "rank 1 raised RuntimeError: fault injected for a test"),
    ("exit_early", "rank 1 exited (exit code 0) before finishing its work"),
    ("skip_collective", f"rank 1 skipped a collective: it issued {F_LABEL} as collective #1 "
                        f"of seed 11 equivalence where the plan has {G_LABEL}"),
])
def test_a_faulty_rank_fails_the_run_fast_and_leaves_no_process(commands, world2, kind, expected):
    for name in COMMANDS:  # let the other subprocesses finish: only this run's may come and go
        commands[name]()
    before = _descendants()  # world2 has started the forkserver (it stays, as multiprocessing's)
    start = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_distributed(2, [11], MODES, timeout=FAULT_TIMEOUT_S, dtensor=False,
                        fault={"rank": 1, "kind": kind})
    elapsed = time.monotonic() - start
    message = str(e.value)
    assert e.value.rank == 1 and "\n" not in message
    assert message.startswith("real-rank run failed: " + expected), message
    # raise / exit: the peer's connection drops at once; a skipped collective is only seen when
    # a rank's wait times out: timeout + 1 s grace + stopping the processes
    assert elapsed < (FAULT_TIMEOUT_S if kind != "skip_collective" else FAULT_TIMEOUT_S + 2.5), elapsed
    assert _descendants() - before == set()


# --- the step the real ranks run -------------------------------------------------------------

@pytest.mark.parametrize("cfg", [Config(world_size=1), Config(seq=8, world_size=1,
                                                               sequence_parallel=True)], ids=str)
def test_a_real_rank_runs_the_engines_train_step_on_one_local_rank(cfg, monkeypatch, tmp_path):
    """Plain TP and SP on a one-process gloo group: each job is ``engine.train_step`` once,
    on ``[1, ...]`` tensors and ``RealRanks``."""
    import torch.distributed as dist

    import tpattn.real.ranks as ranks_module
    from tpattn.parallel.engine import train_step

    calls = []

    def counted(p, x, target, cfg_, inj, comm, lr, rng=None):
        calls.append((x.shape[0], type(comm).__name__, comm.ranks))
        return train_step(p, x, target, cfg_, inj, comm, lr, rng)

    monkeypatch.setattr(ranks_module, "train_step", counted)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        out = ranks_module.run_rank(0, ranks_module.RunPlan(cfg=cfg, jobs=(("equivalence", 11),)))
    finally:
        dist.destroy_process_group()
    assert calls == [(1, "RealRanks", [0])]
    assert out["results"][0]["passed"] and out["results"][0]["forward_max_abs_diff"] < TOLERANCE
