"""Tier-1 diagnosis of the TP x DP mesh's bugs (``HELD_OUT_MESH``, ``TUNING_MESH``)."""
import pytest

from tpattn.config import Config
from tpattn.diagnosis.diagnose import NO_KNOWN_CAUSE, diagnose, evidence_of, lowest_tier
from tpattn.diagnosis.evaluate import (HELD_OUT, HELD_OUT_MESH, MESH_SEEDS, TUNING_MESH,
                                       single_bug_cases)
from tpattn.diagnosis.observe import observe

MESH_MODES = ("loss_reduced_over_world", "loss_full_tensor_tp_only", "dp_grad_group_of_one",
              "sp_gather_wrong_group")


def test_mesh_modes_are_seen_at_tier_1():
    for mode in MESH_MODES:
        assert lowest_tier(mode) == 1
        assert all(line.startswith("tier 1") for line in evidence_of(mode))


def test_tuning_shape_names_each_mesh_bug_and_clears_correct_tp():
    name, cfg, modes = TUNING_MESH[0]
    for seed in (21, 34):
        assert diagnose(observe("equivalence", seed, cfg, reference=False))[0]["cause"] \
            == NO_KNOWN_CAUSE
        for mode in modes:
            found = diagnose(observe(mode, seed, cfg, reference=False))
            assert found[0]["cause"] == mode and not found[0]["tied_with"], (mode, found[0])


def test_held_out_mesh_cases_name_the_bug_at_tier_1():
    cases = single_bug_cases(MESH_SEEDS[:1], shapes=HELD_OUT_MESH)
    tier1 = {k: v for k, v in cases.items() if k[0] == 1}
    assert len(tier1) == sum(len(m) for _, _, m in HELD_OUT_MESH)
    named = sum(v in ("right", "tied") for v in tier1.values())
    assert named >= 0.9 * len(tier1), tier1


def test_mesh_shapes_are_apart_from_the_earlier_held_out_set():
    assert all(cfg.data_parallel == 1 for _, cfg, _ in HELD_OUT)
    assert all(cfg.data_parallel > 1 for _, cfg, _ in HELD_OUT_MESH)


def test_plain_tp_observables_have_no_mesh_keys():
    obs = observe("equivalence", 11, Config(), reference=False)
    assert "loss_shares" not in obs and "data_parallel" not in obs["setup"]
    assert not any(k.startswith("dp ") for k in obs["replica_checksums"]["after_1"])


@pytest.mark.parametrize("mode,line", [
    ("loss_reduced_over_world", "W times the sum of the ranks' loss shares"),
    ("loss_full_tensor_tp_only", "rank 0's replica's own share"),
    ("dp_grad_group_of_one", "differs across the DP replicas"),
    ("sp_gather_wrong_group", "runs over the DP group where the plan has the TP group"),
])
def test_mesh_evidence_says_what_the_job_shows(mode, line):
    cfg = TUNING_MESH[0][1]
    found = diagnose(observe(mode, 21, cfg, reference=False))
    assert any(line in e for e in found[0]["evidence"])


def test_every_mesh_mode_is_held_out_on_the_mesh_shapes():
    from tpattn.bugs.zoo import MESH_NEEDS, REGISTRY

    mesh = {n for n, m in REGISTRY.items() if set(m.needs) & set(MESH_NEEDS)}
    assert mesh == {m for _, _, modes in HELD_OUT_MESH for m in modes} == set(MESH_MODES)
