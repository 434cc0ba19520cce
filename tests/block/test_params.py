"""Sharding by complete query/KV head groups reassembles the dense parameters exactly."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpattn import Config, clone_trainable, init_params, shard_params
from tpattn.block.params import rank_head_slices

from tests.strategies import valid_configs


@given(cfg=valid_configs(), seed=st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_shards_reassemble_the_dense_params(cfg, seed):
    p = init_params(cfg, seed)
    shards = shard_params(p, cfg)
    assert len(shards) == cfg.world_size
    assert torch.equal(torch.cat([s["wq"] for s in shards], 0), p["wq"])
    assert torch.equal(torch.cat([s["wk"] for s in shards], 0), p["wk"])
    assert torch.equal(torch.cat([s["wv"] for s in shards], 0), p["wv"])
    assert torch.equal(torch.cat([s["wo"] for s in shards], 1), p["wo"])
    assert all(s["norm"] is p["norm"] for s in shards)
    for s in shards:  # per-rank shapes: complete groups, column- / row-parallel
        assert s["wq"].shape == (cfg.local_query_heads * cfg.head_dim, cfg.hidden)
        assert s["wk"].shape == s["wv"].shape == (cfg.local_kv_heads * cfg.head_dim, cfg.hidden)
        assert s["wo"].shape == (cfg.hidden, cfg.local_query_heads * cfg.head_dim)


@given(cfg=valid_configs())
@settings(max_examples=40, deadline=None)
def test_every_rank_holds_the_kv_heads_its_query_heads_read(cfg):
    for rank in range(cfg.world_size):
        q_rows, kv_rows = rank_head_slices(cfg, rank)
        q_heads = range(q_rows.start // cfg.head_dim, q_rows.stop // cfg.head_dim)
        kv_heads = set(range(kv_rows.start // cfg.head_dim, kv_rows.stop // cfg.head_dim))
        assert {h // cfg.group_size for h in q_heads} == kv_heads


def test_shard_gradients_land_in_the_dense_parameters():
    cfg = Config()
    p = clone_trainable(init_params(cfg, 0))
    shard_params(p, cfg)[1]["wo"].sum().backward()
    q_rows, _ = rank_head_slices(cfg, 1)
    expected = torch.zeros_like(p["wo"])
    expected[:, q_rows] = 1
    assert torch.equal(p["wo"].grad, expected)


def test_init_params_is_deterministic_and_float64_sees_the_float32_numbers():
    a, b = init_params(Config(), 7), init_params(Config(), 7)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = init_params(Config(dtype="float64"), 7)
    assert all(c[k].dtype == torch.float64 and torch.equal(c[k].float(), a[k]) for k in a)


@pytest.mark.parametrize("rank", [-1, 2, 1.0, True, "0"])
def test_rank_out_of_range_is_a_clear_error(rank):
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, world_size=2\)"):
        rank_head_slices(Config(), rank)


def test_copied_shards_get_gradients_too_slicing_is_differentiable():
    # views only save memory: an index-copy (advanced indexing) carries the gradient as well
    cfg = Config()
    p = clone_trainable(init_params(cfg, 0))
    q_rows, _ = rank_head_slices(cfg, 1)
    copied = p["wo"][:, torch.arange(q_rows.start, q_rows.stop)]
    assert copied._base is None  # a copy, not a view
    copied.sum().backward()
    expected = torch.zeros_like(p["wo"])
    expected[:, q_rows] = 1
    assert torch.equal(p["wo"].grad, expected)


def test_run_takes_the_sharding_as_an_argument():
    import tpattn
    calls = []

    def counting_shards(params, cfg):
        calls.append(cfg)
        return shard_params(params, cfg)

    def swapped_ranks(params, cfg):  # wrong: each rank's wo columns belong to the other rank
        shards = shard_params(params, cfg)
        return [{**s, "wo": shards[-1 - r]["wo"]} for r, s in enumerate(shards)]

    default = tpattn.run(11)
    assert tpattn.run(11, shard_fn=shard_params) == default  # bit-identical
    assert tpattn.run(11, shard_fn=counting_shards) == default and calls
    assert not tpattn.run(11, shard_fn=swapped_ranks)["passed"]
