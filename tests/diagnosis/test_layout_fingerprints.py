"""The fingerprints of the SP and KV-replica bugs, on seeds and shapes they were not written on.

Written on seeds 21 and 34 of ``Config(seq=8, sequence_parallel=True)`` and
``Config(query_heads=8, kv_heads=2, world_size=4)``; held out here: other seeds, four ranks
under SP, MQA on two ranks. Without a reference run (tier 1) the two dropped reductions are
named from the ledger and the replica checksums alone, and so is the averaged norm gradient:
its all-reduce has op avg where the plan has sum.
"""
import pytest

import tpattn
from tpattn import Config
from tpattn.diagnosis.diagnose import NO_KNOWN_CAUSE

SP_SHAPES = (Config(seq=8, sequence_parallel=True, world_size=2),
             Config(seq=8, world_size=4, query_heads=8, kv_heads=4, sequence_parallel=True))
KV_SHAPES = (Config(query_heads=8, kv_heads=2, world_size=4),
             Config(query_heads=4, kv_heads=1, world_size=2))
SEEDS = (101, 202)


def _top(mode, cfg, seed, reference):
    found = tpattn.diagnose(tpattn.observe(mode, seed=seed, cfg=cfg, reference=reference))
    return found[0]["cause"], found[0]["tied_with"], [c["cause"] for c in found]


@pytest.mark.parametrize("reference", (False, True), ids=("tier1", "with-good-run"))
@pytest.mark.parametrize("seed", SEEDS)
def test_dropped_layout_reductions_are_named_alone(seed, reference):
    for mode, shapes in (("missing_norm_grad_reduce", SP_SHAPES),
                         ("missing_kv_grad_reduce", KV_SHAPES)):
        for cfg in shapes:
            top, tied, _ = _top(mode, cfg, seed, reference)
            assert (top, tied) == (mode, []), (mode, cfg, seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_an_averaged_norm_gradient_is_named_from_the_ledger_op(seed):
    for cfg in SP_SHAPES:
        for reference in (False, True):
            top, tied, _ = _top("norm_grad_averaged", cfg, seed, reference)
            assert (top, tied) == ("norm_grad_averaged", []), (cfg, reference)


@pytest.mark.parametrize("seed", SEEDS)
def test_correct_runs_on_both_layouts_have_no_cause(seed):
    for cfg in SP_SHAPES + KV_SHAPES:
        for reference in (False, True):
            assert _top("equivalence", cfg, seed, reference)[2] == [NO_KNOWN_CAUSE], cfg
