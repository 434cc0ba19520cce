"""Dropout (Megatron's RNG discipline) and qk-norm: the model options and their two bugs."""
from __future__ import annotations

import pytest
import torch

import tpattn
from tpattn.block.dense import dense_forward
from tpattn.check.core import (MEASURES, TOLERANCE, dropout_masks, make_inputs, make_params,
                               shard, unshard)
from tpattn.config import Config
from tpattn.parallel.collectives import QK_NORM_GRAD_LABEL
from tpattn.parallel.injection import Injection
from tpattn.parallel.rng import (MODEL_PARALLEL_SEED_OFFSET, drift_by_loader, keep_mask,
                                 replica_masks, simulated_streams, state_checksum,
                                 tile_masks)
from tpattn.parallel.simulated import simulated_step

DROP = Config(dropout=0.1)
QKN = Config(qk_norm=True)
BOTH = Config(dropout=0.2, qk_norm=True)
WIDE = Config(dropout=0.1, qk_norm=True, query_heads=8, kv_heads=4, world_size=4, seq=6,
              batch=3, hidden=32)


@pytest.mark.parametrize("cfg", [DROP, QKN, BOTH, WIDE], ids=["drop", "qkn", "both", "wide"])
@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
def test_correct_tp_passes_with_the_options_on(cfg, simulate):
    for seed in (11, 17):
        r = tpattn.run(seed, "equivalence", cfg, simulate=simulate)
        assert r["passed"], r


def test_dropout_changes_the_dense_block_and_masks_are_scaled_bernoulli():
    x, _ = make_inputs(DROP, 11)
    p = make_params(DROP, 11, Injection())
    masks = dropout_masks(DROP, 11)
    assert not torch.equal(dense_forward(x, p, DROP, masks), dense_forward(x, p, DROP))
    for m in masks.values():
        values = m.unique()
        assert len(values) == 2 and values[0] == 0
        assert values[1] == torch.tensor(1.0).div(0.9)  # kept: 1/(1-p) in float32
    assert masks["attention"].shape == (2, 4, 5, 5)
    assert masks["residual"].shape == (5, 2, 16)


def test_streams_follow_megatrons_tracker():
    streams = simulated_streams(WIDE, 11)
    att = streams.attention_masks(WIDE).view(3, 4, 2, 6, 6)  # [B, ranks, heads, S, S]
    res = streams.residual_masks(WIDE)
    for r in range(1, 4):  # outside the sharded region: the same mask on every rank
        assert torch.equal(res[r], res[0])
        assert not torch.equal(att[:, r], att[:, 0])  # inside: each rank its own
    g = torch.Generator().manual_seed(11 + MODEL_PARALLEL_SEED_OFFSET + 2)
    assert torch.equal(att[:, 2], keep_mask((3, 2, 6, 6), 0.1, g, torch.float32))
    assert len(set(streams.default_checksums())) == 1


def test_rank0_drift_is_a_real_dataloader_draw():
    g = torch.Generator().manual_seed(5)
    before = state_checksum(g)
    drift_by_loader(g)
    assert state_checksum(g) != before
    h = torch.Generator().manual_seed(5)
    torch.empty((), dtype=torch.int64).random_(generator=h)  # the base_seed draw
    assert torch.equal(g.get_state(), h.get_state())
    drifted = simulated_streams(DROP, 11, Injection(rng="rank0_drift"))
    sums = drifted.default_checksums()
    assert sums[0] != sums[1]
    res = drifted.residual_masks(DROP)
    assert not torch.equal(res[0], res[1])


def test_tile_masks_repeats_one_replica_along_the_batch():
    one = replica_masks(DROP, 11)
    assert all(torch.equal(a, b) for a, b in zip(tile_masks(one, 1).values(), one.values()))
    two = tile_masks(one, 2)
    assert torch.equal(two["attention"][2:], one["attention"])
    assert torch.equal(two["residual"][:, 2:], one["residual"])


def test_qk_norm_params_have_their_own_generator():
    plain = make_params(Config(), 11, Injection())
    p = make_params(QKN, 11, Injection())
    assert all(torch.equal(plain[k], p[k]) for k in plain)
    assert p["q_norm"].shape == (4,) and not torch.equal(p["q_norm"], p["k_norm"])
    shards = shard(p, QKN, Injection())
    assert all(s["q_norm"] is p["q_norm"] for s in shards)
    full = unshard(shards, QKN, Injection())
    assert torch.equal(full["k_norm"], p["k_norm"])


def _step(cfg, inj, seed=11):
    base = make_params(cfg, seed, inj)
    x, t = make_inputs(cfg, seed)
    rng = simulated_streams(cfg, seed, inj) if cfg.dropout > 0 else None
    return simulated_step(shard(base, cfg, inj), [(x, t)] * cfg.world_size, cfg, inj, 0.05,
                          rng=rng)


def test_ledger_has_the_after_backward_reduce_only_with_qk_norm():
    entry = {"collective": "all_reduce", "phase": "after backward", "group": "tp",
             "label": QK_NORM_GRAD_LABEL, "op": "sum"}
    assert entry in _step(QKN, Injection())["ledger"]
    assert entry not in _step(QKN, Injection(qk_norm_grad="none"))["ledger"]
    assert all(e["phase"] != "after backward" for e in _step(DROP, Injection())["ledger"])


def test_qk_norm_grads_are_summed_and_counted_once():
    good = _step(QKN, Injection())
    bad = _step(QKN, Injection(qk_norm_grad="none"))
    for k in ("q_norm", "k_norm"):
        assert torch.equal(good["grads"][k][0], good["grads"][k][1])
        torch.testing.assert_close(bad["grads"][k].sum(0), good["grads"][k][0],
                                   rtol=1e-5, atol=1e-7)
    w = bad["weights"]["q_norm"]
    assert not torch.equal(w[0], w[1])  # the replicas drift apart
    replicated = ("norm", "q_norm", "k_norm")
    norm = torch.sqrt(sum((g[0] if k in replicated else g).double().pow(2).sum()
                          for k, g in good["grads"].items()))
    assert abs(good["grad_norm"] - float(norm)) <= 1e-9 * float(norm)


@pytest.mark.parametrize("cfg", [DROP, WIDE], ids=["drop", "wide"])
@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
def test_dropout_rng_desync_fails_every_measure_but_dx_on_other_ranks(cfg, simulate):
    r = tpattn.run(11, "dropout_rng_desync", cfg, simulate=simulate)
    assert not r["passed"]
    assert r["forward_max_abs_diff"] > 1e-2 and r["parameter_grad_max_abs_diff"] > 1e-3
    assert r["loss_abs_diff"] > 1e-4


@pytest.mark.parametrize("cfg", [QKN, WIDE], ids=["qkn", "wide"])
@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
def test_qk_norm_grad_not_reduced_fails_on_gradients_only(cfg, simulate):
    r = tpattn.run(11, "qk_norm_grad_not_reduced", cfg, simulate=simulate)
    assert not r["passed"]
    for m in MEASURES[:3]:
        assert r[m] < TOLERANCE
    assert r["parameter_grad_max_abs_diff"] > 1e-3
    assert r["post_step_weight_max_abs_diff"] > 1e-5


def test_modes_name_the_option_they_need():
    with pytest.raises(ValueError, match="needs dropout > 0"):
        tpattn.run(11, "dropout_rng_desync", QKN)
    with pytest.raises(ValueError, match="needs qk_norm"):
        tpattn.run(11, "qk_norm_grad_not_reduced", DROP)
    from tpattn.bugs.zoo import REGISTRY, runnable_modes

    for name in ("dropout_rng_desync", "qk_norm_grad_not_reduced"):
        assert name not in runnable_modes()
        assert REGISTRY[name].fidelity == "mechanism" and REGISTRY[name].citation
    assert "dropout_rng_desync" in REGISTRY["inputs_not_replicated"].fidelity_note


def test_engine_asks_for_streams_with_dropout():
    from tpattn.parallel.simulated import simulated_forward

    base = make_params(DROP, 11, Injection())
    x, _ = make_inputs(DROP, 11)
    with pytest.raises(ValueError, match="rng must be"):
        simulated_forward(shard(base, DROP, Injection()), [x, x], DROP, Injection())


def test_cli_flags():
    from tpattn.cli import main

    assert main(["--dropout", "0.1", "--mode", "dropout_rng_desync"]) == 0
    assert main(["--qk-norm", "--mode", "equivalence", "--strict"]) == 0
    with pytest.raises(SystemExit) as e:
        main(["--dropout", "1"])
    assert e.value.code == 2
