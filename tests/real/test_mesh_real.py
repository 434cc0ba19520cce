"""A TP x DP mesh on real ranks (``tpattn.real.ranks`` on ``RealRanks``): 4 gloo processes, TP 2 x DP 2,
groups from ``init_device_mesh``. Every mesh mode and correct TP give the simulated ranks'
five measures (within 1e-6 relative, or both below the package's ``TOLERANCE`` where the
measure is rounding) and the same ledger; torchrun's CLI prints the same JSON."""
import json
import pathlib
import subprocess
import sys

import pytest

from tpattn import MEASURES, TOLERANCE, Config
from tpattn.bugs.modes import run
from tpattn.check.core import LR, block_inputs, make_params, rank_batches, shard
from tpattn.parallel.simulated import simulated_step
from tpattn.real.ranks import run_distributed

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)

MESH = Config(data_parallel=2)
MESH_SP = Config(data_parallel=2, sequence_parallel=True, seq=4)
MODES = ("equivalence", "loss_reduced_over_world", "loss_full_tensor_tp_only",
         "dp_grad_group_of_one")
SP_MODES = ("equivalence", "sp_gather_wrong_group", "dp_grad_group_of_one")
TORCHRUN = [str(pathlib.Path(sys.executable).with_name("torchrun")), "--standalone",
            "--nproc-per-node", "4", "-m", "tpattn.distributed", "--tp", "2", "--dp", "2",
            "--mode", "loss_reduced_over_world"]


@pytest.fixture(scope="module")
def torchrun():
    proc = subprocess.Popen(TORCHRUN, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    yield lambda: proc.communicate(timeout=240)
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def mesh(torchrun):  # torchrun runs meanwhile
    return run_distributed(2, [11], MODES, MESH, dtensor=False)


@pytest.fixture(scope="module")
def mesh_sp(mesh):
    return run_distributed(2, [11], SP_MODES, MESH_SP, dtensor=False)


def simulated_ledger(cfg, mode):
    from tpattn.bugs.modes import resolve

    inj = resolve(mode, cfg).injection
    base = make_params(cfg, 11, inj)
    return simulated_step(shard(base, cfg, inj) * cfg.data_parallel,
                          block_inputs(rank_batches(cfg, 11, inj), cfg), cfg, inj, LR)["ledger"]


def agree(real: float, sim: float) -> bool:
    return (real < TOLERANCE and sim < TOLERANCE) or abs(real - sim) <= 1e-6 * abs(sim)


@pytest.mark.parametrize("report,cfg,modes", [("mesh", MESH, MODES),
                                              ("mesh_sp", MESH_SP, SP_MODES)])
def test_real_mesh_equals_simulated(report, cfg, modes, request):
    rep = request.getfixturevalue(report)
    assert [r["mode"] for r in rep.results] == list(modes)
    for real in rep.results:
        sim = run(11, real["mode"], cfg, "ranks")
        assert real["passed"] == sim["passed"] == (real["mode"] == "equivalence")
        for m in MEASURES:
            assert agree(real[m], sim[m]), (real["mode"], m, real[m], sim[m])
    for row in rep.ledger:
        assert row["entries"] == simulated_ledger(cfg, row["mode"]), row["mode"]


def test_real_replicas_drift_only_without_the_dp_all_reduce(mesh, mesh_sp):
    for rep in (mesh, mesh_sp):
        for d in rep.rank_disagreement:
            drift = d["dp_replica_weight_max_diff"]
            assert (drift > 1e-4) if d["mode"] == "dp_grad_group_of_one" else drift == 0.0


def test_real_ledger_names_the_groups(mesh, mesh_sp):
    groups = {row["mode"]: [(e["label"], e["group"]) for e in row["entries"]]
              for row in mesh.ledger + mesh_sp.ledger}
    assert ("all-reduce of the logged loss", "world") in groups["loss_reduced_over_world"]
    assert not any("logged loss" in label for label, _ in groups["loss_full_tensor_tp_only"])
    assert ("all-reduce of gradients over the DP group", "self") in groups[
        "dp_grad_group_of_one"]
    assert ("all-gather of n along the sequence", "dp") in groups["sp_gather_wrong_group"]


def test_torchrun_cli_on_a_mesh(torchrun, mesh):
    out, err = torchrun()
    result = json.loads(out)
    sim = run(11, "loss_reduced_over_world", MESH, "ranks")
    assert result["mode"] == "loss_reduced_over_world" and not result["passed"]
    assert all(agree(result[m], sim[m]) for m in MEASURES)


def test_self_started_cli_on_a_mesh_and_its_one_line_errors():
    proc = subprocess.run([sys.executable, "-m", "tpattn.distributed", "--tp", "2", "--dp", "2",
                           "--mode", "dp_grad_group_of_one"], cwd=ROOT, text=True,
                          capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    sim = run(11, "dp_grad_group_of_one", MESH, "ranks")
    assert not result["passed"] and all(agree(result[m], sim[m]) for m in MEASURES)
    bad = subprocess.run([sys.executable, "-m", "tpattn.distributed", "--tp", "4", "--dp", "2",
                          "--mode", "equivalence"], cwd=ROOT, text=True, capture_output=True,
                         timeout=240)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1
    assert "needs kv_heads >= world_size" in bad.stderr


@pytest.fixture(scope="module")
def observed(mesh_sp):
    from tpattn.diagnosis.observe_real import diagnose_rank
    from tpattn.real.launch import run_on_ranks
    from tpattn.real.ranks import RunPlan

    jobs = tuple((m, 5) for m in ("equivalence", "loss_reduced_over_world",
                                   "loss_full_tensor_tp_only", "dp_grad_group_of_one",
                                   "sp_gather_wrong_group"))
    plan = RunPlan(cfg=MESH_SP, jobs=jobs, timeout=60)
    results, _ = run_on_ranks(diagnose_rank, MESH_SP.ranks, plan, timeout=240, backend="gloo")
    return plan, results[0]


def test_real_mesh_observables_and_diagnoses_equal_the_simulated_ones(observed):
    from tests.real.test_observe_real import assert_same_observables
    from tpattn.diagnosis.diagnose import diagnose
    from tpattn.diagnosis.observe import observe

    plan, rank0 = observed
    for (mode, seed), obs, found in zip(plan.jobs, rank0["observations"], rank0["diagnoses"]):
        simulated = observe(mode, seed, MESH_SP)
        assert_same_observables(obs, simulated, mode)
        assert found == diagnose(simulated), mode
        assert found[0]["cause"] == ("no known cause" if mode == "equivalence" else mode)


ALL_ON = Config(query_heads=8, kv_heads=4, data_parallel=2, dropout=0.1, qk_norm=True)
ALL_ON_MODES = ("equivalence", "dropout_rng_desync", "qk_norm_grad_not_reduced")


def test_real_mesh_with_dropout_and_qk_norm_equals_simulated(mesh_sp):
    rep = run_distributed(2, [11], ALL_ON_MODES, ALL_ON, dtensor=False)
    for real in rep.results:
        sim = run(11, real["mode"], ALL_ON, "ranks")
        assert real["passed"] == sim["passed"] == (real["mode"] == "equivalence")
        for m in MEASURES:
            assert agree(real[m], sim[m]), (real["mode"], m, real[m], sim[m])
