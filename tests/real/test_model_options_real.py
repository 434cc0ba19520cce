"""Dropout and qk-norm on real gloo ranks (``tpattn.real.ranks``): correct TP passes, the
two bugs fail, and every measure equals the simulated ranks' within 1e-6 relative; the
replicas' disagreement shows each bug where it lives."""
import pytest

import tpattn
from tpattn import MEASURES, Config
from tpattn.parallel.collectives import QK_NORM_GRAD_LABEL
from tpattn.real.ranks import planned_ledger, run_distributed

pytestmark = pytest.mark.timeout(300)

CFG = Config(dropout=0.1, qk_norm=True)
MODES = ("equivalence", "dropout_rng_desync", "qk_norm_grad_not_reduced")
SEEDS = (11, 17)
#: Relative distance allowed between a real and a simulated measure (same numbers up to the
#: order of float32 sums).
REL = 1e-6


@pytest.fixture(scope="module")
def world2():
    return run_distributed(2, seeds=SEEDS, modes=MODES, config=CFG, dtensor=False)


def test_real_ranks_equal_simulated_ranks(world2):
    simulated = [tpattn.run(s, m, CFG, simulate="ranks") for m in MODES for s in SEEDS]
    assert [(r["mode"], r["seed"]) for r in world2.results] == \
        [(s["mode"], s["seed"]) for s in simulated]
    for r, s in zip(world2.results, simulated):
        assert r["passed"] == s["passed"] == (r["mode"] == "equivalence")
        for m in MEASURES:
            assert abs(r[m] - s[m]) <= REL * max(abs(s[m]), 1.0), (r["mode"], m)


def test_disagreement_shows_where_each_bug_lives(world2):
    rows = {(d["mode"], d["seed"]): d for d in world2.rank_disagreement}
    for seed in SEEDS:
        good = rows[("equivalence", seed)]
        assert all(v == 0 for k, v in good.items() if k.endswith("_max_rank_diff"))
        drift = rows[("dropout_rng_desync", seed)]  # rank 0's residual mask differs
        assert drift["output_max_rank_diff"] > 1e-2 and drift["q_norm_after_step_max_rank_diff"] == 0
        qk = rows[("qk_norm_grad_not_reduced", seed)]  # forward agrees, replicas drift
        assert qk["output_max_rank_diff"] == 0 and qk["q_norm_after_step_max_rank_diff"] > 1e-5


def test_the_plan_has_the_after_backward_reduce_unless_the_bug_skips_it():
    def labels(mode, cfg):
        return [e["label"] for e in planned_ledger(mode, cfg)]
    assert QK_NORM_GRAD_LABEL in labels("equivalence", CFG)
    assert QK_NORM_GRAD_LABEL not in labels("qk_norm_grad_not_reduced", CFG)
    assert QK_NORM_GRAD_LABEL not in labels("equivalence", Config(dropout=0.1))
    assert planned_ledger("equivalence", CFG)[-1]["phase"] == "step"  # the gradient norm


# --- observables and diagnosis on real ranks ---------------------------------------------

@pytest.fixture(scope="module")
def observed():
    from tpattn.diagnosis.observe_real import diagnose_rank
    from tpattn.real.launch import run_on_ranks
    from tpattn.real.ranks import RunPlan

    plan = RunPlan(cfg=CFG, jobs=tuple((m, 5) for m in MODES), timeout=60)
    results, _ = run_on_ranks(diagnose_rank, 2, plan, timeout=240, backend="gloo")
    return plan, results[0]


def test_real_observables_equal_the_simulated_ones(observed):
    from tests.real.test_observe_real import assert_same_observables
    from tpattn.diagnosis.diagnose import diagnose
    from tpattn.diagnosis.observe import observe

    plan, rank0 = observed
    for (mode, seed), real, found in zip(plan.jobs, rank0["observations"], rank0["diagnoses"]):
        simulated = observe(mode, seed, CFG)
        assert_same_observables(real, simulated, mode)  # ledgers identical, numbers 1e-6
        assert found == diagnose(simulated)
        assert found[0]["cause"] == (mode if mode != "equivalence" else "no known cause")


def test_real_observables_show_each_bug(observed):
    plan, rank0 = observed
    obs = dict(zip((m for m, _ in plan.jobs), rank0["observations"]))
    assert len(set(obs["equivalence"]["rng_state_checksums"])) == 1
    drift = obs["dropout_rng_desync"]
    assert len(set(drift["rng_state_checksums"])) == 2  # tp_rank 0's state moved
    assert len(set(drift["batch_checksums"])) == 1  # the data are identical
    qk = obs["qk_norm_grad_not_reduced"]
    assert len(set(qk["replica_checksums"]["after_1"]["q_norm"])) == 2
    assert len(qk["ledger"]) == len(qk["planned_ledger"]) - 1
