"""Loading a fused QKV checkpoint into ranks (``check.core.shard``'s loader layouts):
``"grouped"`` is correct TP (all five measures pass, the same numbers as ``"heads"``),
``unshard`` inverts it, and gradients reach the dense parameters through the loader.

Tolerances: ``TOLERANCE`` (1e-6 absolute) on the five measures, float32 rounding ~1e-7 at
these sizes; shards and their inverse are slices, compared exactly.
"""
import pytest
import torch

import tpattn
from tpattn import Config
from tpattn.check.core import (LOADERS, check_injection, load_rank_shard, make_params, shard,
                               unshard)
from tpattn.parallel.injection import Injection

GROUPED_SHAPES = [Config(), Config(query_heads=8, kv_heads=4),
                  Config(seq=4, query_heads=16, kv_heads=8, world_size=4),
                  Config(seq=6, hidden=32, query_heads=16, kv_heads=8, head_dim=4)]


@pytest.mark.parametrize("cfg", GROUPED_SHAPES, ids=str)
@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
def test_correct_tp_with_the_grouped_checkpoint_passes_all_five_measures(cfg, simulate):
    for seed in (11, 29):
        result = check_injection(seed, "grouped", Injection(shard="grouped"), cfg, simulate)
        assert result["passed"] is True, result


@pytest.mark.parametrize("cfg", GROUPED_SHAPES, ids=str)
def test_grouped_shards_are_the_heads_shards_and_unshard_inverts_them(cfg):
    base = make_params(cfg, 11, Injection())
    heads, grouped = shard(base, cfg, Injection()), shard(base, cfg, Injection(shard="grouped"))
    for a, b in zip(heads, grouped):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in LOADERS:
        inj = Injection(shard=name)
        if name == "fused_rank0":
            continue  # ranks >= 1 never read their rows: nothing to invert
        back = unshard(shard(base, cfg, inj), cfg, inj)
        assert all(torch.equal(back[k], base[k]) for k in base), name


def test_load_rank_shard_is_each_ranks_own_part_of_shard():
    cfg = Config(seq=4, query_heads=16, kv_heads=8, world_size=4)
    for name in LOADERS:
        inj = Injection(shard=name, bias="after_g")
        base = make_params(cfg, 5, inj)
        every = shard(base, cfg, inj)
        for r in range(cfg.world_size):
            mine = load_rank_shard(base, cfg, inj, r)
            assert mine.keys() == every[r].keys()
            assert all(torch.equal(mine[k], every[r][k]) for k in mine), (name, r)


@pytest.mark.parametrize("name", list(LOADERS))
def test_gradients_reach_the_dense_parameters_through_the_loader(name):
    cfg = Config(query_heads=8, kv_heads=4)
    inj = Injection(shard=name)
    base = {k: t.clone().requires_grad_(True) for k, t in make_params(cfg, 3, inj).items()}
    loss = sum((s[k] * (r + 1)).sum() for r, s in enumerate(shard(base, cfg, inj))
               for k in ("wq", "wk", "wv", "wo"))
    loss.backward()
    # every loaded element has weight rank + 1: the grads sum to what the ranks loaded
    expected = sum((r + 1) * s[k].numel() for r, s in enumerate(shard(base, cfg, inj))
                   for k in ("wq", "wk", "wv", "wo"))
    got = sum(float(base[k].grad.sum()) for k in ("wq", "wk", "wv", "wo"))
    assert got == expected
    if name == "fused_rank0":  # ranks >= 1 read rank 0's rows: rank 1's rows get nothing
        assert float(base["wq"].grad[16:].abs().sum()) == 0.0
        assert float(base["wo"].grad[:, 16:].abs().sum()) > 0.0  # wo is cut right
