"""The LM's global gradient norm on TP ranks counts each replicated parameter once (the norms
and ``mlp_norm`` on TP rank 0, replicated wk/wv on the first rank of their replica group): it
equals the dense LM's norm (float64, within 1e-12 relative; observed <= 1e-15), and a clipped TP
step equals the clipped dense step on the five measures."""
from dataclasses import replace

import pytest

from tpattn.block.kv_layout import kv_grad_bug_applies
from tpattn.check.core import LR
from tpattn.check.measures import MEASURES, five_measures
from tpattn.config import Config
from tpattn.model.config import LMConfig
from tpattn.model.job import dense_lm_job, simulated_lm_job
from tpattn.model.tp import LM_CORRECT, gather_lm_step
from tpattn.parallel.engine import MAX_GRAD_NORM
from tpattn.parallel.program import grad_squares
from tpattn.parallel.wrong import grad_squares_per_rank

SEED = 11


def make_lm(world_size: int, tied: bool) -> LMConfig:
    return LMConfig(block=Config(world_size=world_size, dtype="float64"), tied=tied)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_tp_norm_equals_the_dense_norm(world_size, tied):
    lm = make_lm(world_size, tied)
    assert kv_grad_bug_applies(lm.block) is (world_size == 4)  # W=4: wk/wv replicated
    dense = dense_lm_job(lm, SEED, LR)["grad_norm"]
    tp = simulated_lm_job(lm, SEED, LR)["grad_norm"]
    assert tp == pytest.approx(dense, rel=1e-12)


@pytest.mark.parametrize("squares", [grad_squares, grad_squares_per_rank],
                         ids=["block_names", "every_rank"])
def test_counting_replicas_on_every_rank_inflates_the_norm(squares):
    lm = make_lm(2, False)  # the block's REPLICATED misses "layers.0.norm" and "mlp_norm"
    dense = dense_lm_job(lm, SEED, LR)["grad_norm"]
    wrong = simulated_lm_job(lm, SEED, LR, replace(LM_CORRECT, grad_squares=squares))
    assert wrong["grad_norm"] > dense * (1 + 1e-6)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_clipped_tp_step_equals_the_clipped_dense_step(world_size):
    lm = make_lm(world_size, True)
    dense = dense_lm_job(lm, SEED, LR, clip=True)
    assert dense["grad_norm"] > 2 * MAX_GRAD_NORM  # the clip scales the update
    unclipped = dense_lm_job(lm, SEED, LR)
    assert five_measures(SEED, "clip", unclipped, dense)["post_step_weight_max_abs_diff"] > 1e-4
    tp = gather_lm_step(simulated_lm_job(lm, SEED, LR, replace(LM_CORRECT, clip=True)), lm)
    measures = five_measures(SEED, "clip", dense, tp)
    assert max(measures[m] for m in MEASURES) < 1e-12
