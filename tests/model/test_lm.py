"""The decoder LM on simulated TP ranks against its dense twin: the five measures at world sizes
2 and 4, tied and untied, float64 and float32, with the MLP's bias; the ledger; f and g dropped
by substitution."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tpattn.check.measures import MEASURES, five_measures
from tpattn.config import Config
from tpattn.model import job
from tpattn.model.config import LMConfig
from tpattn.model.dense import dense_lm_step, lm_forward
from tpattn.model.params import (init_lm_params, layer_key, shard_lm_params,
                                 unshard_lm_params)
from tpattn.model.tp import (EMBED_G_LABEL, HEAD_F_LABEL, LM_CORRECT, MLP_F_LABEL, MLP_G_LABEL,
                             gather_lm_step, lm_grad_norm, tp_lm_step, vocab_parallel_lookup)
from tpattn.parallel.collectives import (CE_MAX_LABEL, CE_SUM_EXP_LABEL, CE_TARGET_LABEL,
                                         F_LABEL, G_LABEL, SimulatedRanks)
from tpattn.parallel.engine import GRAD_NORM_LABEL, stack_ranks

LR = 0.05
#: float64: observed <= 1e-15 on every measure; the bound leaves 1000x for other shapes.
#: float32: observed <= 5e-7 (eps 1.2e-7 times O(1) logits, summed over ranks in another
#: order than one matmul, through two layers); the bound leaves 20x.
TOLERANCES = {"float64": 1e-12, "float32": 1e-5}


def make_lm(world_size: int, dtype: str = "float64", tied: bool = False, **block) -> LMConfig:
    return LMConfig(block=Config(world_size=world_size, dtype=dtype, **block), tied=tied)


def make_tokens(lm: LMConfig, seed: int = 3) -> torch.Tensor:
    """``tpattn.model.job.make_tokens``, checked: inputs and next-token targets fall in every
    rank's vocabulary slice."""
    tokens = job.make_tokens(lm, seed)
    per_rank = lm.vocab // lm.block.world_size
    for ids in (tokens[:-1], tokens[1:]):
        assert set(ids.div(per_rank, rounding_mode="floor").flatten().tolist()) \
            == set(range(lm.block.world_size))
    return tokens


def both_steps(lm: LMConfig, prog=LM_CORRECT, seed: int = 11, ledger=None):
    """The dense step and the TP step (``prog``) from the same parameters and tokens."""
    p, tokens = init_lm_params(lm, seed), make_tokens(lm)
    w = lm.block.world_size
    tp = tp_lm_step(stack_ranks(shard_lm_params(p, lm)), tokens.expand(w, -1, -1), lm,
                    SimulatedRanks(lm.block, ledger), LR, prog)
    return dense_lm_step(tokens, p, lm, LR), tp


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_lm_equals_the_dense_lm_on_the_five_measures(world_size, tied, dtype):
    lm = make_lm(world_size, dtype, tied)
    dense, tp = both_steps(lm)
    measures = five_measures(11, "equivalence", dense, gather_lm_step(tp, lm))
    assert {m: measures[m] for m in MEASURES if measures[m] >= TOLERANCES[dtype]} == {}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_lm_with_the_mlp_bias_equals_the_dense_lm(world_size, dtype):
    lm = replace(make_lm(world_size, dtype), mlp_bias=True)
    dense, tp = both_steps(lm)
    measures = five_measures(11, "equivalence", dense, gather_lm_step(tp, lm))
    assert {m: measures[m] for m in MEASURES if measures[m] >= TOLERANCES[dtype]} == {}
    bias = dense["grads"][layer_key(0, "b_down")]
    assert float(bias.abs().max()) > 1e-3  # the bias takes part in the step
    for i in range(lm.layers):  # every rank holds the whole bias gradient
        grads = tp["grads"][layer_key(i, "b_down")]
        assert torch.equal(grads, grads[:1].expand_as(grads))
    rel = TOLERANCES[dtype]
    assert tp["grad_norm"] == pytest.approx(dense["grad_norm"], rel=rel)
    bias_norm = lm_grad_norm({k: tp["grads"][k] for k in tp["grads"] if "b_down" in k},
                             SimulatedRanks(lm.block))  # counted on one rank, not W
    torch.testing.assert_close(bias_norm, sum(
        dense["grads"][layer_key(i, "b_down")].double().pow(2).sum()
        for i in range(lm.layers)).sqrt(), rtol=rel, atol=0)


@pytest.mark.parametrize("block", [
    {"query_heads": 8, "kv_heads": 4},  # W=4: a whole KV head per rank
    {"kv_heads": 2, "kv_strategy": "gather_activations"},  # W=4: K/V gathered
    {"kv_heads": 1, "query_heads": 4, "seq": 7, "batch": 3},  # W=4: one KV head, 4 replicas
], ids=["kv4", "kv_gather", "kv1"])
def test_other_block_shapes_at_world_size_four(block):
    lm = LMConfig(block=Config(world_size=4, dtype="float64", **block), vocab=64, layers=3,
                  ffn=32)
    dense, tp = both_steps(lm, seed=17)
    measures = five_measures(17, "equivalence", dense, gather_lm_step(tp, lm))
    assert max(measures[m] for m in MEASURES) < TOLERANCES["float64"]


def test_the_ranks_hold_one_loss_and_identical_replicated_gradients():
    lm = make_lm(4, "float32")
    _, tp = both_steps(lm)
    assert torch.equal(tp["losses"], tp["losses"][:1].expand(4))
    assert torch.equal(tp["input_grads"], tp["input_grads"][:1].expand_as(tp["input_grads"]))
    for key in ["norm"] + [layer_key(i, n) for i in range(lm.layers) for n in ("norm", "mlp_norm")]:
        grads = tp["grads"][key]
        assert torch.equal(grads, grads[:1].expand_as(grads)), key


def test_the_ledger_names_each_collective_in_order():
    ledger = []
    both_steps(replace(make_lm(2), layers=1), ledger=ledger)
    assert [(e["phase"], e["label"]) for e in ledger] == [
        ("forward", EMBED_G_LABEL), ("forward", G_LABEL), ("forward", MLP_G_LABEL),
        ("forward", CE_MAX_LABEL), ("forward", CE_TARGET_LABEL), ("forward", CE_SUM_EXP_LABEL),
        ("backward", HEAD_F_LABEL), ("backward", MLP_F_LABEL), ("backward", F_LABEL),
        ("step", GRAD_NORM_LABEL)]


def keep(t, comm, label=None):
    """A dropped collective: ``t`` as it is, forward and backward."""
    return t


def test_dropping_g_after_the_embedding_breaks_the_forward():
    lm = make_lm(2)
    dense, tp = both_steps(lm, replace(LM_CORRECT, embed_g=keep))
    measures = five_measures(11, "no_embed_g", dense, gather_lm_step(tp, lm))
    assert measures["forward_max_abs_diff"] > 1e-2
    assert measures["loss_abs_diff"] > 1e-3


def test_dropping_f_before_the_mlp_keeps_forward_and_loss_but_breaks_gradients():
    lm = make_lm(2)
    _, right = both_steps(lm)
    dense, wrong = both_steps(lm, replace(LM_CORRECT, mlp_f=keep))
    assert torch.equal(wrong["outputs"], right["outputs"])
    assert torch.equal(wrong["losses"], right["losses"])
    measures = five_measures(11, "no_mlp_f", dense, gather_lm_step(wrong, lm))
    assert measures["input_grad_max_abs_diff"] > 1e-4
    last = lm.layers - 1
    grads = gather_lm_step(wrong, lm)["grads"]
    for name in ("w_gate", "w_up", "w_down"):  # after f in the last layer: still right
        torch.testing.assert_close(grads[layer_key(last, name)],
                                   dense["grads"][layer_key(last, name)], rtol=0, atol=1e-12)
    for key in (layer_key(last, "mlp_norm"), layer_key(0, "wq"), "embed"):  # upstream: wrong
        assert (grads[key] - dense["grads"][key]).abs().max() > 1e-4, key


@pytest.mark.parametrize("tied", [False, True])
def test_shards_cut_the_vocabulary_and_ffn_and_unshard_back(tied):
    lm = make_lm(4, tied=tied)
    p = init_lm_params(lm, 5)
    shards = shard_lm_params(p, lm)
    assert shards[1]["embed"].shape == (lm.vocab // 4, lm.block.hidden)
    assert torch.equal(shards[1]["embed"], p["embed"][8:16])
    assert torch.equal(shards[2][layer_key(0, "w_down")], p[layer_key(0, "w_down")][:, 24:36])
    assert torch.equal(shards[3][layer_key(1, "w_up")], p[layer_key(1, "w_up")][36:])
    assert ("head" in shards[0]) is not tied
    back = unshard_lm_params(shards, lm)
    assert list(back) == list(p) and all(torch.equal(back[k], p[k]) for k in p)


def test_the_mlp_bias_is_replicated_follows_its_down_and_leaves_the_other_draws():
    lm = make_lm(4)
    plain, p = init_lm_params(lm, 5), init_lm_params(replace(lm, mlp_bias=True), 5)
    keys = list(p)
    for i in range(lm.layers):
        key = layer_key(i, "b_down")
        assert p[key].shape == (lm.block.hidden,) and float(p[key].abs().max()) > 0
        assert keys.index(key) == keys.index(layer_key(i, "w_down")) + 1
    assert [k for k in keys if "b_down" not in k] == list(plain)
    assert all(torch.equal(plain[k], p[k]) for k in plain)
    shards = shard_lm_params(p, replace(lm, mlp_bias=True))
    assert all(torch.equal(s[layer_key(1, "b_down")], p[layer_key(1, "b_down")]) for s in shards)
    back = unshard_lm_params(shards, replace(lm, mlp_bias=True))
    assert list(back) == keys and all(torch.equal(back[k], p[k]) for k in p)


def test_the_lookup_zeroes_other_ranks_tokens_and_sums_to_the_embedding():
    lm = make_lm(4)
    p, tokens = init_lm_params(lm, 5), make_tokens(lm)
    embed = stack_ranks(shard_lm_params(p, lm))["embed"]
    partials = vocab_parallel_lookup(tokens.expand(4, -1, -1), embed, SimulatedRanks(lm.block))
    owner = tokens // (lm.vocab // 4)
    for rank in range(4):
        assert (partials[rank][owner != rank] == 0).all()
        assert (partials[rank][owner == rank] != 0).all()
    assert torch.equal(partials.sum(0), F.embedding(tokens, p["embed"]))


def test_init_is_deterministic_and_tied_has_no_head():
    lm = make_lm(2)
    a, b, c = init_lm_params(lm, 5), init_lm_params(lm, 5), init_lm_params(lm, 6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed"], c["embed"])
    assert not torch.equal(a[layer_key(0, "wq")], a[layer_key(1, "wq")])
    assert "head" in a and "head" not in init_lm_params(replace(lm, tied=True), 5)


def test_the_dense_lm_is_causal():
    lm = make_lm(2)
    p, tokens = init_lm_params(lm, 5), make_tokens(lm)
    changed = tokens.clone()
    changed[-1] = (changed[-1] + 1) % lm.vocab
    before, after = lm_forward(tokens, p, lm), lm_forward(changed, p, lm)
    assert torch.equal(before[:-1], after[:-1])
    assert not torch.equal(before[-1], after[-1])
