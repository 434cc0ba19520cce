"""Diagnosis per tier on held-out cases (``tpattn.diagnosis.evaluate``): seeds 500-501 and
shapes the fingerprints were not written on, two bugs at once, bugs outside the registry."""
import json

import pytest

from tpattn.bugs.zoo import REGISTRY
from tpattn.cli import main
from tpattn.diagnosis.diagnose import FINGERPRINTS, lowest_tier
from tpattn.diagnosis.evaluate import (MADE_UP, made_up_cases, single_bug_cases, summary,
                                       two_bug_cases)

SEEDS = (500, 501)


@pytest.fixture(scope="module")
def single():
    return single_bug_cases(SEEDS)


def test_tier_1_is_honest_on_every_held_out_single_bug(single):
    counts = summary(single, 1)["all"]
    assert counts["wrong"] == 0 and counts["missed"] == 0, counts
    # what tier 1 names, it names alone: the bugs it cannot see are the tier-2 ones
    blind = {m for (t, m, _, _), c in single.items() if t == 1 and c == "blind"}
    assert blind == {m for m in FINGERPRINTS if lowest_tier(m) == 2} & {m for (_, m, _, _) in single}


def test_tier_2_names_the_true_bug_top_or_tied(single):
    counts = summary(single, 2)["all"]
    n = sum(counts.values())
    assert counts["right"] + counts["tied"] >= 0.95 * n, counts
    assert counts["wrong"] == 0, counts


def test_a_made_up_bug_never_gets_one_registry_name():
    answers = made_up_cases(SEEDS[:1])
    assert len(answers) == 2 * len(MADE_UP)
    assert set(answers.values()) <= {"no known cause", "tie"}, answers


def test_two_bugs_at_once_never_blame_a_third():
    cases = two_bug_cases(SEEDS[:1])
    assert len(cases) >= 2 * 30
    assert not any(outside for _, outside in cases.values())


def test_list_modes_gives_every_bug_its_lowest_tier(capsys):
    assert main(["--list-modes"]) == 0
    modes = json.loads(capsys.readouterr().out)
    tiers = {m["name"]: m["lowest_tier"] for m in modes}
    assert tiers["equivalence"] is None
    assert all(tiers[m] in (1, 2) for m in REGISTRY if m != "equivalence")
    assert tiers["missing_input_grad_reduce"] == 1 and tiers["norm_grad_averaged"] == 2


def test_a_job_that_all_reduces_its_loss_is_diagnosed_as_well(single):
    # Megatron's vocab-parallel cross entropy logs one loss for the TP group: the ranks'
    # losses agree by construction, so no fingerprint may need them to disagree.
    reduced = single_bug_cases(SEEDS, logged_loss="all_reduced")
    assert reduced == single


def test_logged_loss_is_checked():
    from tpattn import observe

    with pytest.raises(ValueError, match=r"logged_loss must be one of per_rank, all_reduced"):
        observe("equivalence", logged_loss="mean")
