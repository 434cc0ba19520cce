"""Observing and diagnosing on real ranks (``tpattn.diagnosis.observe_real``).

- on real gloo ranks every registry mode's observables equal the simulated ranks' (the same
  keys, ledgers and flags; every number within 1e-6 relative), and so does the diagnosis;
- ``torchrun -m tpattn.distributed --diagnose`` and ``python -m tpattn.distributed --diagnose``
  add the same ``diagnosis`` as ``python -m tpattn --simulate ranks --diagnose``.

Process start dominates the cost: one run of the ranks per shape serves every mode.
"""
import json
import subprocess
import sys

import pytest

from tpattn import Config
from tpattn.bugs.zoo import REGISTRY, resolve
from tpattn.cli import main as cli_main
from tpattn.diagnosis.diagnose import diagnose
from tpattn.diagnosis.observe import observe
from tpattn.diagnosis.observe_real import diagnose_rank
from tpattn.real.launch import run_on_ranks
from tpattn.real.ranks import RunPlan

from tests.conftest import ROOT
from tests.real.test_distributed import _torchrun

pytestmark = pytest.mark.timeout(300)

#: Relative distance allowed between a real and a simulated observable: the two hold the
#: same numbers up to the order of float32 sums (measured ≤ 1.3e-7).
REL = 1e-6

SHAPES = {
    "plain W2": Config(),
    "SP W2": Config(seq=8, sequence_parallel=True),
    "KV W4": Config(seq=4, hidden=32, query_heads=8, kv_heads=2, head_dim=8, world_size=4),
    "KV gather W4": Config(seq=4, hidden=32, query_heads=8, kv_heads=2, head_dim=8,
                           world_size=4, kv_strategy="gather_activations"),
}


def _modes(cfg: Config) -> list[str]:
    modes = []
    for mode in REGISTRY:
        try:
            resolve(mode, cfg, strict=True)
        except ValueError:
            continue
        modes.append(mode)
    return modes


def _leaves(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, obj


def assert_same_observables(real: dict, simulated: dict, what: str) -> None:
    a, b = dict(_leaves(real)), dict(_leaves(simulated))
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for path, x in a.items():
        y = b[path]
        if isinstance(x, float) and not isinstance(y, bool):
            assert abs(x - y) <= REL * max(abs(x), abs(y), 1.0), (what, path, x, y)
        else:
            assert x == y, (what, path, x, y)


@pytest.fixture(scope="module", params=list(SHAPES))
def real_run(request):
    cfg = SHAPES[request.param]
    plan = RunPlan(cfg=cfg, jobs=tuple((m, 5) for m in _modes(cfg)), timeout=60)
    results, _ = run_on_ranks(diagnose_rank, cfg.world_size, plan, timeout=240, backend="gloo")
    return request.param, cfg, plan, results[0]


def test_real_observables_and_diagnoses_equal_the_simulated_ones(real_run):
    name, cfg, plan, rank0 = real_run
    assert len(rank0["observations"]) == len(plan.jobs) >= 3
    for (mode, seed), obs, found in zip(plan.jobs, rank0["observations"], rank0["diagnoses"]):
        simulated = observe(mode, seed, cfg)
        assert_same_observables(obs, simulated, f"{name} {mode}")
        assert found == diagnose(simulated), (name, mode)


def test_real_ledger_records_every_collective_of_the_step(real_run):
    name, cfg, plan, rank0 = real_run
    by_mode = dict(zip((m for m, _ in plan.jobs), rank0["observations"]))
    correct = by_mode["equivalence"]
    assert correct["ledger"] == correct["planned_ledger"]
    assert correct["ledger"][-1] == {"collective": "all_reduce", "phase": "step", "group": "tp",
                                     "op": "sum"}
    if "missing_kv_grad_reduce" in by_mode:
        groups = [e["group"] for e in by_mode["missing_kv_grad_reduce"]["ledger"]]
        assert "kv_replicas" in [e["group"] for e in correct["ledger"]]
        assert "kv_replicas" not in groups


CLI = ["--mode", "missing_input_grad_reduce", "--seed", "3", "--diagnose"]


@pytest.mark.parametrize("launcher", ["torchrun", "self-started"])
def test_distributed_cli_diagnose_matches_the_simulated_cli(launcher, capsys):
    argv = (_torchrun() + ["--standalone", "--nproc-per-node", "2"]) if launcher == "torchrun" \
        else [sys.executable]
    proc = subprocess.run(argv + ["-m", "tpattn.distributed", *CLI, "--timeout", "60"], cwd=ROOT,
                          text=True, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    real = json.loads(proc.stdout)
    assert cli_main(["--simulate", "ranks", *CLI]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert real["diagnosis"] == simulated["diagnosis"]
    assert real["diagnosis"][0]["cause"] == "missing_input_grad_reduce"
