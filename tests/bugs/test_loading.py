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


# --- the two registry modes ------------------------------------------------------------------

CFG_KV4 = Config(query_heads=8, kv_heads=4)  # two KV groups per rank


@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
def test_both_loading_bugs_fail_on_the_forward_and_every_measure_after_it(simulate):
    for mode in ("qkv_loaded_from_rank0", "grouped_qkv_read_as_plain"):
        for seed in (11, 29, 500):
            result = tpattn.run(seed, mode, CFG_KV4, simulate)
            assert result["passed"] is False
            # the forward is another block's: O(0.1) off, far above rounding
            assert result["forward_max_abs_diff"] > 1e-1, (mode, seed)
            for m in tpattn.MEASURES:
                assert result[m] > 10 * tpattn.TOLERANCE, (mode, seed, m)


def test_the_registry_entries_cite_and_inject_the_loader_bugs():
    rank0 = tpattn.bugs.zoo.resolve("qkv_loaded_from_rank0")
    plain = tpattn.bugs.zoo.resolve("grouped_qkv_read_as_plain")
    assert rank0.injection == Injection(shard="fused_rank0")
    assert plain.injection == Injection(shard="grouped_as_plain")
    assert "vllm-gguf-plugin issue 103" in rank0.citation and "PR 106" in rank0.citation
    assert "tt-metal issue 6243" in plain.citation
    assert rank0.fidelity == plain.fidelity == "mechanism"
    assert rank0.injection.correct() == Injection(shard="fused")
    assert plain.injection.correct() == Injection(shard="grouped")
    assert "kv_heads >= 2 * world_size" in plain.needs
    # plain-TP modes of the chapter "Around the block": listed and runnable, but kept out of
    # runnable_modes() (the earlier chapters' hunts and tables keep their cases)
    assert tpattn.bugs.zoo.AROUND_THE_BLOCK == (rank0.name, plain.name)
    listed = {m["name"]: m for m in tpattn.bugs.zoo.list_modes()}
    for mode in (rank0.name, plain.name):
        assert mode not in tpattn.bugs.zoo.runnable_modes()
        assert listed[mode]["runnable"] and listed[mode]["fidelity"] == "mechanism"


def test_rank0_loader_is_the_loader_called_without_tp_rank():
    """Every rank's Q/K/V rows are rank 0's (the shapes right); wo and norm are each rank's."""
    cfg = Config(seq=4, query_heads=16, kv_heads=8, world_size=4)
    inj = Injection(shard="fused_rank0")
    base = make_params(cfg, 7, inj)
    loaded, right = shard(base, cfg, inj), shard(base, cfg, Injection())
    for r in range(cfg.world_size):
        for k in ("wq", "wk", "wv"):
            assert torch.equal(loaded[r][k], right[0][k])
            assert (r == 0) == torch.equal(loaded[r][k], right[r][k])
        assert torch.equal(loaded[r]["wo"], right[r]["wo"])


def test_read_as_plain_needs_two_groups_per_rank_with_one_it_is_correct():
    """tt-metal issue 6243: with one group per device the op's assumption held."""
    for cfg in (Config(), Config(query_heads=8, kv_heads=4, world_size=4)):
        for simulate in ("fixture", "ranks"):
            result = check_injection(11, "grouped_qkv_read_as_plain",
                                     Injection(shard="grouped_as_plain"), cfg, simulate)
            assert result["passed"] is True, (cfg, result)
        with pytest.raises(ValueError, match="needs kv_heads >= 2 \\* world_size"):
            tpattn.bugs.zoo.resolve("grouped_qkv_read_as_plain", cfg, strict=True)
    assert tpattn.run(11, "grouped_qkv_read_as_plain", CFG_KV4)["passed"] is False


def test_the_fixture_view_of_the_rank0_loader_is_the_simulated_ranks_rank0_view():
    """One graph would share rank 0's rows among the ranks (their gradients summed there);
    the fixture reports the simulated ranks' rank-0 view instead (check.core.tp_step)."""
    for seed in (11, 500):
        fixture = tpattn.run(seed, "qkv_loaded_from_rank0", CFG_KV4, "fixture")
        assert fixture == tpattn.run(seed, "qkv_loaded_from_rank0", CFG_KV4, "ranks")
    # the grouped loaders hand every rank its own rows: one graph is exact there
    fixture = tpattn.run(11, "grouped_qkv_read_as_plain", CFG_KV4, "fixture")
    ranks = tpattn.run(11, "grouped_qkv_read_as_plain", CFG_KV4, "ranks")
    assert all(abs(fixture[m] - ranks[m]) <= tpattn.TOLERANCE for m in tpattn.MEASURES)
