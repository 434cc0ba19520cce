"""``run(shard_fn=...)`` on simulated ranks gathers grads and weights by the cut's own layout."""
import pytest
import torch

import tpattn
from tpattn.block.params import rank_head_slices, shard_params


def reversed_ranks(params, cfg):
    """Correct TP with the ranks' head groups swapped: rank r holds rank W-1-r's heads."""
    return shard_params(params, cfg)[::-1]


def heads_round_robin(params, cfg):
    """Wrong: query head h on rank h % W, KV heads in contiguous blocks (copies of rows)."""
    d, shards = cfg.head_dim, []
    for rank in range(cfg.world_size):
        rows = torch.cat([torch.arange(h * d, (h + 1) * d)
                          for h in range(rank, cfg.query_heads, cfg.world_size)])
        _, kv_rows = rank_head_slices(cfg, rank)
        shards.append({"norm": params["norm"], "wq": params["wq"][rows],
                       "wk": params["wk"][kv_rows], "wv": params["wv"][kv_rows],
                       "wo": params["wo"][:, rows]})
    return shards


def detached(params, cfg):
    """The package's cut as copies that autograd cannot see through."""
    return [{k: v.detach().clone() for k, v in s.items()} for s in shard_params(params, cfg)]


@pytest.mark.parametrize("seed", [5, 11, 23])
@pytest.mark.parametrize("cut", [reversed_ranks, detached])
def test_a_correct_cut_passes_on_ranks(seed, cut):
    result = tpattn.run(seed, tpattn.EQUIVALENCE, simulate="ranks", shard_fn=cut)
    assert result["passed"], {m: result[m] for m in tpattn.MEASURES}


@pytest.mark.parametrize("cfg", [tpattn.Config(), tpattn.Config(query_heads=8, kv_heads=4,
                                                                 world_size=4)])
def test_a_wrong_cut_reads_the_same_on_ranks_and_in_one_graph(cfg):
    ranks = tpattn.run(11, tpattn.EQUIVALENCE, cfg, simulate="ranks",
                       shard_fn=heads_round_robin)
    graph = tpattn.run(11, tpattn.EQUIVALENCE, cfg, simulate="fixture",
                       shard_fn=heads_round_robin)
    assert not ranks["passed"]
    for m in tpattn.MEASURES:
        assert ranks[m] == pytest.approx(graph[m], rel=1e-4, abs=1e-6), m
