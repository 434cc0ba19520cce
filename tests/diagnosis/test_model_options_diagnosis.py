"""Tier-1 observables and fingerprints of the dropout and qk-norm bugs (simulated ranks).

The held-out figures (``evaluate.MODEL_HELD_OUT``, seeds 500-504) are measured by
``bench/diagnosis_tiers.py --model``; here one seed per shape keeps the test short."""
import pytest

from tpattn import Config
from tpattn.diagnosis.diagnose import DEVIATIONS, diagnose, features, deviations
from tpattn.diagnosis.evaluate import MODEL_HELD_OUT, classify
from tpattn.diagnosis.observe import observe

DROP = Config(dropout=0.1)
QKN = Config(qk_norm=True)


def test_new_observables_appear_only_with_the_options():
    plain = observe("equivalence", 3, Config(), reference=False)
    assert "rng_state_checksums" not in plain and "dropout" not in plain["setup"]
    assert "q_norm" not in plain["replica_checksums"]["after_1"]
    drop = observe("equivalence", 3, DROP, reference=False)
    assert len(set(drop["rng_state_checksums"])) == 1 and drop["setup"]["dropout"] == 0.1
    qkn = observe("equivalence", 3, QKN, reference=False)
    assert qkn["setup"]["qk_norm"] is True
    assert {"q_norm", "k_norm"} <= set(qkn["replica_checksums"]["after_1"])
    for obs in (drop, qkn):
        assert deviations(features(obs)) == []
        assert diagnose(obs)[0]["cause"] == "no known cause"


def test_dropout_rng_desync_shows_rng_states_with_equal_batches():
    obs = observe("dropout_rng_desync", 3, DROP, reference=False)
    assert len(set(obs["batch_checksums"])) == 1
    assert obs["rng_state_checksums"][0] != obs["rng_state_checksums"][1]
    assert "rng_states" in deviations(features(obs))
    assert diagnose(obs)[0]["cause"] == "dropout_rng_desync"
    # the job all-reducing its loss hides the losses, not the RNG states
    reduced = observe("dropout_rng_desync", 3, DROP, reference=False, logged_loss="all_reduced")
    assert diagnose(reduced)[0]["cause"] == "dropout_rng_desync"


def test_qk_norm_grad_not_reduced_shows_the_missing_reduce_and_drifting_replicas():
    obs = observe("qk_norm_grad_not_reduced", 3, QKN, reference=False)
    seen = deviations(features(obs))
    assert {"after_bwd_short", "qk_norm_replicas"} <= set(seen)
    assert DEVIATIONS["qk_norm_replicas"][1] == 1
    found = diagnose(obs)
    assert found[0]["cause"] == "qk_norm_grad_not_reduced" and not found[0]["tied_with"]


@pytest.mark.parametrize("name, cfg, modes", MODEL_HELD_OUT, ids=[s[0] for s in MODEL_HELD_OUT])
def test_held_out_shapes_name_each_bug_at_tier_1(name, cfg, modes):
    for mode in modes:
        found = diagnose(observe(mode, 500, cfg, reference=False))
        assert classify(found, mode) in ("right", "tied"), (name, mode, found[0])
