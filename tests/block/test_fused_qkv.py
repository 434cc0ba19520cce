"""Fused QKV checkpoints (``tpattn.block.fused_qkv``): both layouts round-trip exactly, the
loader narrows the right rows (and rank 0's without ``tp_rank``), gradients flow back through
it, and a grouped block read as plain ``[Q; K; V]`` equals the grouped reading only when a rank
holds one group. Every comparison is exact (``torch.equal``): these are slices, no arithmetic.
"""
import pytest
import torch

from tpattn import Config
from tpattn.block.fused_qkv import (fuse_qkv_weight, load_qkv_weight,
                                    rank_row_block, read_rank_qkv, split_qkv_weight)
from tpattn.block.params import init_params, shard_params

SHAPES = [Config(), Config(query_heads=8, kv_heads=4), Config(query_heads=6, kv_heads=2),
          Config(seq=4, query_heads=16, kv_heads=8, world_size=4),
          Config(query_heads=8, kv_heads=8, world_size=4)]


def _params(cfg, seed=3):
    return init_params(cfg, seed)


@pytest.mark.parametrize("cfg", SHAPES, ids=str)
@pytest.mark.parametrize("layout", ["plain", "grouped"])
def test_both_layouts_round_trip_exactly(cfg, layout):
    p = _params(cfg)
    fused = fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, layout)
    assert fused.shape == ((cfg.query_heads + 2 * cfg.kv_heads) * cfg.head_dim, cfg.hidden)
    back = split_qkv_weight(fused, cfg, layout)
    assert all(torch.equal(a, p[k]) for a, k in zip(back, ("wq", "wk", "wv")))
    assert torch.equal(fuse_qkv_weight(*back, cfg, layout), fused)


@pytest.mark.parametrize("cfg", SHAPES, ids=str)
def test_plain_and_grouped_convert_into_each_other_and_back(cfg):
    p = _params(cfg)
    plain = fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, "plain")
    grouped = fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, "grouped")
    def convert(w, src, dst):
        return fuse_qkv_weight(*split_qkv_weight(w, cfg, src), cfg, dst)

    assert torch.equal(convert(plain, "plain", "grouped"), grouped)
    assert torch.equal(convert(grouped, "grouped", "plain"), plain)
    assert torch.equal(convert(plain, "plain", "plain"), plain)
    # a permutation of rows: the same numbers
    assert torch.equal(plain.sum(1).sort().values, grouped.sum(1).sort().values)


def test_the_grouped_layout_is_q_of_the_group_then_k_then_v():
    cfg = Config(query_heads=8, kv_heads=4)  # group size 2
    p = _params(cfg)
    d = cfg.head_dim
    fused = fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, "grouped")
    block = fused[(2 + 2) * d:(2 + 2) * 2 * d]  # group 1: q heads 2, 3; k_1; v_1
    assert torch.equal(block[:2 * d], p["wq"][2 * d:4 * d])
    assert torch.equal(block[2 * d:3 * d], p["wk"][d:2 * d])
    assert torch.equal(block[3 * d:], p["wv"][d:2 * d])


@pytest.mark.parametrize("cfg", SHAPES, ids=str)
@pytest.mark.parametrize("layout", ["plain", "grouped"])
def test_the_loader_with_its_rank_loads_that_ranks_heads(cfg, layout):
    p = _params(cfg)
    fused = fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, layout)
    for rank, want in enumerate(shard_params(p, cfg)):
        got = load_qkv_weight(fused, cfg, layout, tp_rank=rank)
        assert all(torch.equal(a, want[k]) for a, k in zip(got, ("wq", "wk", "wv")))


@pytest.mark.parametrize("layout", ["plain", "grouped"])
def test_the_loader_without_tp_rank_loads_rank_0s_rows(layout):
    cfg = Config(seq=4, query_heads=16, kv_heads=8, world_size=4)
    p = _params(cfg)
    fused = fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, layout)
    rank0 = load_qkv_weight(fused, cfg, layout, tp_rank=0)
    silent = load_qkv_weight(fused, cfg, layout)  # the caller forgot tp_rank
    assert all(torch.equal(a, b) for a, b in zip(silent, rank0))
    rank3 = load_qkv_weight(fused, cfg, layout, tp_rank=3)
    assert all(a.shape == b.shape and not torch.equal(a, b) for a, b in zip(silent, rank3))


def test_gradients_flow_back_through_the_loader_to_the_dense_weights():
    cfg = Config(query_heads=8, kv_heads=4)
    p = {k: t.clone().requires_grad_(True) for k, t in _params(cfg).items()}
    fused = fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, "grouped")
    wq, wk, wv = load_qkv_weight(fused, cfg, "grouped", tp_rank=1)
    (wq.sum() + 2 * wk.sum() + 3 * wv.sum()).backward()
    q_rows, kv_rows = slice(16, 32), slice(8, 16)  # rank 1: query heads 4-7, KV heads 2, 3
    assert torch.equal(p["wq"].grad[q_rows], torch.ones(16, cfg.hidden))
    assert float(p["wq"].grad[:16].abs().sum()) == 0.0
    assert torch.equal(p["wk"].grad[kv_rows], torch.full((8, cfg.hidden), 2.0))
    assert torch.equal(p["wv"].grad[kv_rows], torch.full((8, cfg.hidden), 3.0))


def test_one_group_per_rank_reads_the_same_either_way_two_groups_do_not():
    """tenstorrent/tt-metal issue 6243: reading a device's rows as [Q; K; V] worked with one
    group per device and broke with two."""
    for cfg, same in [(Config(), True), (Config(query_heads=8, kv_heads=4, world_size=4), True),
                      (Config(query_heads=8, kv_heads=4), False),
                      (Config(seq=4, query_heads=16, kv_heads=8, world_size=4), False)]:
        p = _params(cfg)
        fused = fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, "grouped")
        for rank in range(cfg.world_size):
            rows = fused[rank_row_block(cfg, rank)]
            grouped, plain = read_rank_qkv(rows, cfg, "grouped"), read_rank_qkv(rows, cfg, "plain")
            assert all(a.shape == b.shape for a, b in zip(grouped, plain))
            assert all(torch.equal(a, b) for a, b in zip(grouped, plain)) is same, (cfg, rank)


def test_bad_input_names_the_field_and_the_rule():
    cfg = Config()
    p = _params(cfg)
    fused = fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, "plain")
    with pytest.raises(ValueError, match="layout must be one of plain, grouped"):
        fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, "megatron")
    with pytest.raises(ValueError, match="wk must be"):
        fuse_qkv_weight(p["wq"], p["wk"][:4], p["wv"], cfg)
    with pytest.raises(ValueError, match="tp_rank must be an integer in"):
        load_qkv_weight(fused, cfg, "plain", tp_rank=2)
    with pytest.raises(ValueError, match="loaded_weight must be"):
        load_qkv_weight(fused[:-1], cfg, "plain", tp_rank=0)
    with pytest.raises(ValueError, match="read_as must be one of"):
        read_rank_qkv(fused[:16], cfg, "qkv")
    with pytest.raises(ValueError, match="kv_heads must be >= world_size"):
        kv = Config(query_heads=8, kv_heads=2, world_size=4)
        q = _params(kv)
        load_qkv_weight(fuse_qkv_weight(q["wq"], q["wk"], q["wv"], kv, "plain"), kv, "plain")
