"""Diagnosis per tier on held-out cases (``tpattn.diagnosis.evaluate``): a cheap subset of
the held-out set (seed 500, every held-out shape; pairs and made-up bugs on the first shape),
and the pairs of the tuning set. ``bench/diagnosis_tiers.py`` prints the full figures."""
import json
from collections import Counter

import pytest

from tpattn.bugs.zoo import REGISTRY
from tpattn.cli import main
from tpattn.diagnosis.diagnose import FINGERPRINTS, NO_KNOWN_CAUSE, lowest_tier
from tpattn.diagnosis.evaluate import (BOTH_NAMED, HELD_OUT, HELD_OUT_MESH,
                                       LOADING_HELD_OUT, MADE_UP, MODEL_HELD_OUT, TUNING,
                                       made_up_cases, pairs, single_bug_cases, summary,
                                       two_bug_cases)

SEEDS = (500,)


@pytest.fixture(scope="module")
def single():
    """The held-out shapes, those with the model options (dropout, qk-norm) and the
    checkpoint-loading modes' shapes."""
    return {**single_bug_cases(SEEDS), **single_bug_cases(SEEDS, shapes=MODEL_HELD_OUT),
            **single_bug_cases(SEEDS, shapes=LOADING_HELD_OUT)}


def test_tier_1_is_honest_on_every_held_out_single_bug(single):
    counts = summary(single, 1)["all"]
    assert counts["wrong"] == 0 and counts["missed"] == 0, counts
    # what tier 1 names, it names alone: the bugs it cannot see are the tier-2 ones
    blind = {m for (t, m, _, _), c in single.items() if t == 1 and c == "blind"}
    assert blind == {m for m in FINGERPRINTS if lowest_tier(m) == 2} & {m for (_, m, _, _) in single}
    mesh = {m for _, _, modes in HELD_OUT_MESH for m in modes}  # test_mesh_diagnosis.py
    assert {m for (_, m, _, _) in single} == set(REGISTRY) - {"equivalence"} - mesh


def test_tier_2_names_the_true_bug_top_or_tied(single):
    counts = summary(single, 2)["all"]
    n = sum(counts.values())
    assert counts["right"] + counts["tied"] >= 0.95 * n, counts
    assert counts["wrong"] == 0, counts


@pytest.mark.parametrize("cfg", [HELD_OUT[0][1], TUNING[0][1]], ids=["held out", "tuning"])
def test_two_bugs_at_once_are_both_named_at_tier_2(cfg):
    cases = two_bug_cases(SEEDS if cfg is HELD_OUT[0][1] else (0,), cfg)
    assert len(cases) == 2 * len(list(pairs())) >= 2 * 40
    for tier in (1, 2):
        counts = Counter(v for (t, _, _), v in cases.items() if t == tier)
        assert counts["third"] == 0, (tier, counts)  # never a confident third cause
    tier2 = Counter(v for (t, _, _), v in cases.items() if t == 2)
    assert sum(tier2[k] for k in BOTH_NAMED) >= 0.9 * sum(tier2.values()), tier2


def test_a_made_up_bug_never_gets_one_registry_name():
    answers = made_up_cases(SEEDS)
    assert len(answers) == 2 * len(MADE_UP) >= 2 * 8
    assert set(answers.values()) <= {NO_KNOWN_CAUSE, "tie"}, answers


def test_list_modes_gives_every_bug_its_lowest_tier(capsys):
    assert main(["--list-modes"]) == 0
    modes = json.loads(capsys.readouterr().out)
    tiers = {m["name"]: m["lowest_tier"] for m in modes}
    assert tiers["equivalence"] is None
    assert all(tiers[m] in (1, 2) for m in REGISTRY if m != "equivalence")
    # the ledger's op sees an averaged reduction; the per-rank norms a replica counted W times
    for mode in ("missing_input_grad_reduce", "input_grad_reduce_averaged",
                 "norm_grad_averaged", "grad_norm_counts_replicas"):
        assert tiers[mode] == 1, mode
    assert tiers["row_bias_on_every_rank"] == tiers["repeat_kv_tiled"] == 2
    shows = {m["name"]: m["shows"] for m in modes}
    assert shows["equivalence"] == [] and all(shows[m] for m in REGISTRY if m != "equivalence")
    assert "op avg" in shows["input_grad_reduce_averaged"][0]


def test_a_job_that_all_reduces_its_loss_is_diagnosed_as_well(single):
    # Megatron's vocab-parallel cross entropy logs one loss for the TP group: the ranks'
    # losses agree by construction, so no fingerprint may need them to disagree.
    reduced = {**single_bug_cases(SEEDS, logged_loss="all_reduced"),
               **single_bug_cases(SEEDS, logged_loss="all_reduced", shapes=MODEL_HELD_OUT),
               **single_bug_cases(SEEDS, logged_loss="all_reduced", shapes=LOADING_HELD_OUT)}
    assert reduced == single


def test_logged_loss_is_checked():
    from tpattn import observe

    with pytest.raises(ValueError, match=r"logged_loss must be one of per_rank, all_reduced"):
        observe("equivalence", logged_loss="mean")
