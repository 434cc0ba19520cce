"""The LM's tier-1 observables (``tpattn.diagnosis.lm_observe``): correct TP shows none at TP 2
and 4, untied and tied, float32 and bfloat16; each observable is shown by a bug that makes it
(a rank-local cross-entropy, a target logit cut from autograd, a lookup without its mask, shards
loaded from one seed, a dropped f or g, a bias gradient scaled by 1/W) and says where; every
LM bug shows at least one."""
from dataclasses import replace

import pytest
import torch

from tpattn.bugs.lm_zoo import LM_EQUIVALENCE, LM_REGISTRY, lm_program
from tpattn.config import Config
from tpattn.diagnosis.lm_observe import (LM_TIER1, lm_tier1, observe_lm, observe_lm_program)
from tpattn.model.config import LMConfig
from tpattn.model.params import shard_lm_params
from tpattn.model.tp import EMBED_G_LABEL, HEAD_F_LABEL, LM_CORRECT, MLP_F_LABEL, MLP_G_LABEL
from tpattn.parallel.collectives import vocab_offsets

#: 8 query heads and 4 KV heads: every rank holds whole KV heads at TP 2 and 4.
BLOCK = Config(query_heads=8, kv_heads=4, hidden=16, head_dim=4)


def lm_at(world_size: int, dtype: str = "float32", tied: bool = False) -> LMConfig:
    return LMConfig(block=replace(BLOCK, world_size=world_size, dtype=dtype), tied=tied)


def shown(obs: dict) -> dict[str, list[str]]:
    return {o["observable"]: o["where"] for o in lm_tier1(obs)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("world_size", [2, 4])
def test_correct_tp_shows_no_observable(world_size, tied, dtype):
    for seed in (11, 3):
        assert shown(observe_lm(LM_EQUIVALENCE, seed, lm_at(world_size, dtype, tied))) == {}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_bias_gradient_scaled_by_one_over_w_shows_only_there(world_size, dtype):
    lm = replace(lm_at(world_size, dtype), mlp_bias=True)
    assert shown(observe_lm(LM_EQUIVALENCE, 11, lm)) == {}
    biases = ["layers.0.b_down", "layers.1.b_down"]
    assert observe_lm(LM_EQUIVALENCE, 11, lm)["bias_grad_checks"].keys() == set(biases)
    assert shown(observe_lm("row_bias_grad_scaled", 11, lm_at(world_size, dtype))) == {
        "bias_grad_not_dy_sum": biases}  # the mode's setup brings the bias


@pytest.mark.parametrize("name", [n for n in LM_REGISTRY if n != LM_EQUIVALENCE])
def test_every_lm_bug_shows_an_observable(name):
    assert shown(observe_lm(name, 11, lm_at(4))) != {}


def local_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm,
                        smoothing: float = 0.0) -> torch.Tensor:
    """Each rank's loss from its own vocabulary slice alone (no all-reduce, no smoothing):
    logits ``[R, S, B, V/W]``, targets ``[R, S, B]`` -> ``[R, S, B]``."""
    v = logits.shape[-1]
    local = targets - vocab_offsets(comm, v)
    owned = (local >= 0) & (local < v)
    target = logits.gather(-1, torch.where(owned, local, 0).unsqueeze(-1)).squeeze(-1)
    return logits.logsumexp(-1) - torch.where(owned, target, 0.0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_losses_disagree_when_a_rank_uses_its_own_statistics(world_size):
    prog = replace(LM_CORRECT, cross_entropy=local_cross_entropy, name="local_ce")
    where = shown(observe_lm_program(prog, 11, lm_at(world_size)))["losses_disagree"]
    assert where == [f"rank {r}" for r in range(1, world_size)]


def detached_target_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm,
                                  smoothing: float = 0.0) -> torch.Tensor:
    """The correct vocabulary-parallel loss whose target logit is cut from autograd: its
    logit gradient is the softmax alone (no smoothing)."""
    v = logits.shape[-1]
    local = targets - vocab_offsets(comm, v)
    owned = (local >= 0) & (local < v)
    target = logits.gather(-1, torch.where(owned, local, 0).unsqueeze(-1)).squeeze(-1)
    target = torch.where(owned, target, 0.0)
    return LM_CORRECT.cross_entropy(logits, targets, comm) + target - target.detach()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_logit_grads_unbalanced_when_the_target_logit_has_no_gradient(world_size, dtype):
    prog = replace(LM_CORRECT, cross_entropy=detached_target_cross_entropy, name="detached")
    obs = observe_lm_program(prog, 11, lm_at(world_size, dtype))
    n = len(obs["logit_grad_sums"]["sums"])
    assert n == (BLOCK.seq - 1) * BLOCK.batch
    assert shown(obs) == {"logit_grads_unbalanced": [f"{n} of {n} tokens"]}


def unmasked_lookup(tokens: torch.Tensor, embed: torch.Tensor, comm) -> torch.Tensor:
    """The lookup without its mask: a rank adds its local row 0 for a token outside its
    slice."""
    local = tokens - vocab_offsets(comm, embed.shape[1])
    owned = (local >= 0) & (local < embed.shape[1])
    return embed[torch.arange(embed.shape[0]).view(-1, 1, 1), torch.where(owned, local, 0)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_embedding_not_one_owner_when_the_lookup_forgets_its_mask(world_size):
    prog = replace(LM_CORRECT, embed_lookup=unmasked_lookup, name="unmasked")
    obs = observe_lm_program(prog, 11, lm_at(world_size))
    n = BLOCK.seq * BLOCK.batch
    assert obs["embed_owners"] == [world_size] * n
    assert shown(obs)["embedding_not_one_owner"] == [f"{n} of {n} tokens"]
    assert observe_lm(LM_EQUIVALENCE, 11, lm_at(world_size))["embed_owners"] == [1] * n


@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_identical_when_every_rank_loads_rank_0s_numbers(world_size):
    lm = lm_at(world_size)
    same_seed = lambda p, lm: [shard_lm_params(p, lm)[0]] * world_size  # noqa: E731
    obs = observe_lm_program(LM_CORRECT, 11, lm, shard=same_seed)
    where = shown(obs)["shards_identical"]
    assert where == list(obs["shard_checksums"]) and "embed" in where and "head" in where
    assert "norm" not in where and "layers.0.mlp_norm" not in where  # replicated: not split


@pytest.mark.parametrize("mode, replicas, label", [
    ("embed_reduce_missing", None, EMBED_G_LABEL),
    ("mlp_output_reduce_missing", None, MLP_G_LABEL),
    ("mlp_input_grad_reduce_missing", ["layers.0.mlp_norm", "layers.1.mlp_norm"], MLP_F_LABEL),
    ("head_input_grad_reduce_missing", ["norm"], HEAD_F_LABEL),
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_dropped_f_or_g_shows_replicas_differ_and_a_short_ledger(mode, replicas, label, dtype):
    lm_program(mode)  # a mode of the registry
    where = shown(observe_lm(mode, 11, lm_at(4, dtype)))
    assert set(where) == {"replicas_differ", "ledger_short"}
    assert where["ledger_short"] == [label]
    if replicas is not None:  # a dropped f: only the norm before it gets a rank's own gradient
        assert where["replicas_differ"] == replicas


def test_every_observable_says_what_it_shows():
    assert all(shows and callable(test) for shows, test in LM_TIER1.values())
    obs = observe_lm("head_input_grad_reduce_missing")
    assert [o["observable"] for o in lm_tier1(obs)] == ["replicas_differ", "ledger_short"]
    assert lm_tier1(obs)[0]["shows"] == LM_TIER1["replicas_differ"][0]


def test_an_unknown_mode_raises_naming_the_lm_modes():
    with pytest.raises(ValueError, match="mode must be one of the LM's modes"):
        observe_lm("missing_output_reduce")
