"""The engine's one-graph backend (``tpattn.parallel.one_graph.OneGraphRanks``: the seed's
``simulate="fixture"`` semantics, rank 0's view) against the one-graph views the package
wrote once per variant before it (``tests/reference_one_graph.py``), on every mode.

Contract: the rounding bound of ``tests/rounding.py`` (``2 * n * eps * scale``, ``scale`` the
largest value compared, at least 1) on the step's output, loss, input gradient, every
parameter gradient and every weight after the step, and the same pass/fail of the five
measures against the dense step. Seeds 11 and 23; held-out seed 5 at other shapes.
"""
from dataclasses import replace

import pytest
import torch

from tpattn import Config
from tpattn.bugs import zoo
from tpattn.bugs.zoo import REGISTRY
from tpattn.check.core import (SP_MODES, LR, MODES, MISSING_KV_GRAD_REDUCE,
                               PARAM_SEED_OFFSET, dense_reference, five_measures, make_inputs,
                               one_step, tp_step)
from tpattn.block.params import init_params
from tpattn.parallel.injection import Injection
from tpattn.parallel.one_graph import OneGraphRanks, one_graph_forward
from tpattn.parallel.tp import tp_forward
from tests import reference_one_graph as ref
from tests import reference_ranks as ranks_ref
from tests.rounding import assert_within_sum_bound

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _same_step(new: dict, old: dict, cfg: Config) -> None:
    for key in ("output", "loss", "input_grad"):
        assert_within_sum_bound(new[key], old[key], cfg, key)
    assert new["grads"].keys() == old["grads"].keys()
    for k in old["grads"]:
        assert_within_sum_bound(new["grads"][k], old["grads"][k], cfg, f"grad {k}")
        assert_within_sum_bound(new["weights"][k], old["weights"][k], cfg, f"weight {k}")


def _native_case(cfg, seed, mode, old_forward):
    """The engine's one-graph step against ``old_forward``'s; both five measures' rows agree
    on pass/fail. Returns the engine's row. (Under sequence parallelism and replicated KV
    heads this is ``check.core.tp_step``'s fixture path: ``test_run_fixture_is_the_engine``.)"""
    x0, target = make_inputs(cfg, seed)
    base = init_params(cfg, seed + PARAM_SEED_OFFSET)
    dense = dense_reference(x0, target, base, cfg)
    new = one_step(lambda x, p: one_graph_forward(x, p, cfg, REGISTRY[mode].injection),
                   x0, target, base)
    old = one_step(old_forward, x0, target, base)
    _same_step(new, old, cfg)
    assert five_measures(seed, mode, dense, new)["passed"] == \
        five_measures(seed, mode, dense, old)["passed"]
    return five_measures(seed, mode, dense, new)


@pytest.mark.parametrize("cfg", [Config(seq=8, sequence_parallel=True),
                                 Config(query_heads=8, kv_heads=2, world_size=4)])
def test_run_fixture_is_the_engine(cfg):
    """``run(simulate="fixture")`` under these layouts steps the engine on OneGraphRanks."""
    x0, target = make_inputs(cfg, 11)
    base = init_params(cfg, 11 + PARAM_SEED_OFFSET)
    for mode in ("equivalence", "missing_input_grad_reduce"):
        a = tp_step(x0, target, base, cfg, REGISTRY[mode].injection)
        b = one_step(lambda x, p: one_graph_forward(x, p, cfg, REGISTRY[mode].injection),
                     x0, target, base)
        assert torch.equal(a["output"], b["output"]) and torch.equal(a["input_grad"],
                                                                     b["input_grad"])
        assert all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"])


SP = Config(seq=8, sequence_parallel=True)
SP_HELD_OUT = Config(seq=6, batch=1, hidden=12, query_heads=6, kv_heads=3, head_dim=2,
                     world_size=3, sequence_parallel=True)


@pytest.mark.parametrize("cfg,seed", [(SP, 11), (SP, 23), (SP_HELD_OUT, 5)])
@pytest.mark.parametrize("mode", SP_MODES)
def test_sequence_parallel_fixture_is_the_engine(cfg, seed, mode):
    inj = REGISTRY[mode].injection
    row = _native_case(cfg, seed, mode, lambda x, p: ref.sp_forward(
        x, p, cfg, inj.g == 1, inj.f == "sum", inj.norm_grad))
    assert row["passed"] == (mode == "equivalence")  # every SP bug shows in rank 0's view


KV = [Config(query_heads=8, kv_heads=2, world_size=4),
      Config(query_heads=8, kv_heads=2, world_size=4, kv_strategy="gather_activations"),
      Config(query_heads=8, kv_heads=1, world_size=4),
      Config(seq=7, batch=3, hidden=32, query_heads=8, kv_heads=2, world_size=4)]


@pytest.mark.parametrize("cfg", KV, ids=lambda c: f"kv{c.kv_heads}-{c.kv_strategy}-s{c.seq}")
@pytest.mark.parametrize("mode", MODES + (MISSING_KV_GRAD_REDUCE,))
def test_fewer_kv_heads_fixture_is_the_engine(cfg, mode):
    if mode == MISSING_KV_GRAD_REDUCE and cfg.kv_strategy == "gather_activations":
        pytest.skip("no replica-group reduce to drop under gather_activations")
    inj = REGISTRY[mode].injection
    for seed in (11, 23):
        row = _native_case(cfg, seed, mode, lambda x, p: ref.tp_forward_kv(
            x, p, cfg, inj.g == 1, inj.f == "sum", inj.kv_grad == "sum"))
        assert row["passed"] == (mode == "equivalence")


@pytest.mark.parametrize("cfg", [Config(), Config(query_heads=8, kv_heads=4, world_size=4),
                                 Config(dtype="float64", world_size=1)])
@pytest.mark.parametrize("mode", MODES)
def test_plain_tp_engine_path_is_the_rank_batched_block(cfg, mode):
    if cfg.world_size == 1 and mode != "equivalence":
        pytest.skip("one rank: nothing to drop")
    inj = REGISTRY[mode].injection
    _native_case(cfg, 11, mode, lambda x, p: ref.rank_batched_tp_forward(
        x, p, cfg, inj.g == 1, inj.f == "sum"))


def _zoo_old_step(x0, target, base, cfg, inj, seed):
    """The zoo's fixture step with the old ``forward_fixture`` (as ``zoo.tp_side`` runs it)."""
    from tpattn.block.params import clone_trainable
    from tpattn.block.sgd import sgd_step
    import torch.nn.functional as F

    p = clone_trainable(base)
    x = x0.clone().requires_grad_(True)
    xs = [x] * cfg.world_size
    if inj.inputs == "per_rank":
        xs = [x] + [b[0] for b in zoo.rank_batches(cfg, seed, inj)[1:]]
    y = ref.forward_fixture(xs, p, cfg, inj)
    loss = F.mse_loss(y, target)
    loss.backward()
    grads = {k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in p.items()}
    per_rank = zoo.shard(grads, cfg, replace(inj, shard="heads" if inj.shard == "fused_naive"
                                              else inj.shard))
    coef = zoo.clip_coef(ranks_ref.grad_norm(per_rank, inj), inj)
    return {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad, "grads": grads,
            "weights": sgd_step(p, grads, LR, float(coef))}


@pytest.mark.parametrize("seed", [11, 23])
@pytest.mark.parametrize("mode", zoo.runnable_modes())
def test_zoo_fixture_is_the_engine(mode, seed):
    cfg = Config(query_heads=8, kv_heads=4, world_size=2) if "kv_heads >= 2 * world_size" \
        in zoo.resolve(mode).needs else Config()
    inj = zoo.resolve(mode, cfg, strict=True).injection
    x0, target = make_inputs(cfg, seed)
    base = zoo.make_params(cfg, seed, inj)
    dense, new, _ = zoo.sides(mode, seed, cfg, "fixture")
    old = _zoo_old_step(x0, target, base, cfg, inj, seed)
    _same_step(new, old, cfg)
    assert five_measures(seed, mode, dense, new)["passed"] == \
        five_measures(seed, mode, dense, old)["passed"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cfg", [Config(), Config(query_heads=8, kv_heads=4, world_size=4)])
def test_tp_forward_is_the_engine_in_the_fixture_configuration(cfg, mode):
    """The book's short ``tp_forward`` (chapters 6-9) is the engine's block on
    ``OneGraphRanks`` with the mode's injection, in float32, within rounding."""
    inj = REGISTRY[mode].injection
    x0, target = make_inputs(cfg, 11)
    base = init_params(cfg, 11 + PARAM_SEED_OFFSET)
    short = one_step(lambda x, p: tp_forward(x, p, cfg, inj.g == 1, inj.f == "sum"),
                     x0, target, base)
    engine = one_step(lambda x, p: one_graph_forward(x, p, cfg, inj), x0, target, base)
    _same_step(engine, short, cfg)


def test_one_graph_loss_reaches_every_shard_only_through_g():
    """Without g only rank 0's shard learns (rank 0's view); with it every shard does."""
    cfg = Config()
    x0, target = make_inputs(cfg, 11)
    base = init_params(cfg, 11 + PARAM_SEED_OFFSET)
    rows = cfg.local_query_heads * cfg.head_dim
    for g, learns in ((1, True), (0, False)):
        step = one_step(lambda x, p: one_graph_forward(x, p, cfg, Injection(g=g)),
                        x0, target, base)
        assert bool(step["grads"]["wq"][rows:].abs().sum() > 0) == learns
        assert step["grads"]["wq"][:rows].abs().sum() > 0


def test_one_graph_ranks_keeps_no_ledger():
    assert OneGraphRanks(Config()).ledger is None
