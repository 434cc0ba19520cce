"""Tier-1 diagnosis of the checkpoint-loading bugs (``tpattn.diagnosis.diagnose``): the shard
checksums of the live job (what each rank loaded minus the checkpoint slice it should hold)
tell ``qkv_loaded_from_rank0``, ``grouped_qkv_read_as_plain``, ``fused_qkv_naive_split`` and a
checkpoint loaded in the wrong rank order (a made-up bug) apart.

Held out: ``evaluate.LOADING_HELD_OUT``'s shapes, seeds 500 and 501 (the
fingerprints were written on ``evaluate.TUNING``); ``bench/diagnosis_tiers.py --loading``
prints the full figures (seeds 500-504).
"""
import pytest

import tpattn
from tpattn import Config
from tpattn.diagnosis.diagnose import NO_KNOWN_CAUSE, features
from tpattn.diagnosis.evaluate import (HELD_OUT, LOADING_HELD_OUT, LOADING_MODES,
                                       MADE_UP_LOADING, made_up_cases, single_bug_cases,
                                       summary)
from tpattn.diagnosis.observe import observe_injection

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PATTERNS = ("qkv_rank0_only", "qkv_within_rank", "qkv_rank0_queries")


@pytest.mark.parametrize("cfg", [Config(query_heads=8, kv_heads=4),
                                 Config(seq=4, query_heads=16, kv_heads=8, world_size=4)],
                         ids=["W2", "W4"])
def test_each_loading_bug_leaves_its_own_pattern_in_the_shard_checksums(cfg):
    expected = {"qkv_loaded_from_rank0": "qkv_rank0_only",
                "grouped_qkv_read_as_plain": "qkv_within_rank",
                "fused_qkv_naive_split": "qkv_rank0_queries"}
    for seed in (3, 4):
        for mode, pattern in expected.items():
            obs = tpattn.observe(mode, seed, cfg, reference=False)
            f = features(obs)
            assert [p for p in PATTERNS if f[p]] == [pattern], (mode, seed)
            assert f["shards_ok"]["wo"] is True and f["batches_agree"] is True
            found = tpattn.diagnose(obs)
            assert found[0]["cause"] == mode and not found[0]["tied_with"], (mode, found[0])
            assert found[0]["tier"] == 1
        # a whole shard (wo too) from the wrong rank: none of them, no known cause
        for name, inj in MADE_UP_LOADING.items():
            f = features(observe_injection(inj, seed, cfg, reference=False))
            assert not any(f[p] for p in PATTERNS) and f["shards_ok"]["wo"] is False
            found = tpattn.diagnose(observe_injection(inj, seed, cfg, reference=False))
            assert found[0]["cause"] == NO_KNOWN_CAUSE, (name, found[0])


def test_correct_loads_deviate_nowhere():
    for inj in (tpattn.bugs.zoo.Injection(shard="grouped"),
                tpattn.bugs.zoo.Injection(shard="fused")):
        obs = observe_injection(inj, 5, Config(query_heads=8, kv_heads=4), reference=False)
        f = features(obs)
        assert all(f["shards_ok"].values()) and not any(f[p] for p in PATTERNS)
        assert tpattn.diagnose(obs)[0]["cause"] == NO_KNOWN_CAUSE


def test_held_out_tier_1_names_each_loading_bug_in_at_least_90_percent():
    single = single_bug_cases((500, 501), shapes=LOADING_HELD_OUT)
    rows = summary(single, 1)
    for mode in LOADING_MODES:
        n = sum(rows[mode].values())
        assert n >= 10, (mode, n)
        assert rows[mode]["right"] + rows[mode]["tied"] >= 0.9 * n, (mode, rows[mode])
        assert rows[mode]["wrong"] == rows[mode]["missed"] == 0, (mode, rows[mode])


def test_made_up_loading_bugs_never_get_one_registry_name():
    for cfg in (HELD_OUT[0][1], HELD_OUT[1][1]):
        answers = made_up_cases((500,), cfg, MADE_UP_LOADING)
        assert set(answers.values()) <= {NO_KNOWN_CAUSE, "tie"}, answers
