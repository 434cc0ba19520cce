"""The TP x DP mesh on simulated ranks: groups, the check, the mesh's registry modes."""
import json

import pytest
import torch

from tpattn.bugs import zoo
from tpattn.bugs.modes import run
from tpattn.check.core import (LR, MEASURES, TOLERANCE, check_injection, make_inputs,
                               make_params, rank_batches, block_inputs, shard)
from tpattn.cli import main
from tpattn.config import Config
from tpattn.parallel.collectives import SimulatedRanks
from tpattn.parallel.injection import Injection
from tpattn.parallel.simulated import replica_views, simulated_step

MESH = Config(data_parallel=2)
MESH_SP = Config(data_parallel=2, sequence_parallel=True, seq=4)
MESH_MODES = ("loss_reduced_over_world", "loss_full_tensor_tp_only", "dp_grad_group_of_one")


def mesh_step(cfg, inj, seed=11):
    base = make_params(cfg, seed, inj)
    step = simulated_step(shard(base, cfg, inj) * cfg.data_parallel,
                          block_inputs(rank_batches(cfg, seed, inj), cfg), cfg, inj, LR)
    return step


def test_mesh_order_and_groups():
    comm = SimulatedRanks(Config(world_size=2, data_parallel=3))
    assert comm.ranks == [0, 1, 0, 1, 0, 1] and comm.dp_ranks == [0, 0, 1, 1, 2, 2]
    assert comm.groups("tp") == [[0, 1], [2, 3], [4, 5]]
    assert comm.groups("dp") == [[0, 2, 4], [1, 3, 5]]
    t = torch.arange(6.0)
    assert comm.group_sum(t, "tp").tolist() == [1, 1, 5, 5, 9, 9]
    assert comm.group_sum(t, "dp").tolist() == [6, 9, 6, 9, 6, 9]
    plain = SimulatedRanks(Config())
    assert plain.ranks == [0, 1] and plain.dp_ranks == [0, 0]


def test_data_parallel_one_is_plain_tp_bit_for_bit():
    cfg = Config()
    x0, target = make_inputs(cfg, 11)
    torch.manual_seed(11)
    assert torch.equal(x0, torch.randn(cfg.seq, cfg.batch, cfg.hidden))
    step = mesh_step(cfg, Injection())
    assert all(e["group"] == "tp" for e in step["ledger"])
    assert [e["label"] for e in step["ledger"]][-1] == "sum of squared gradient norms"


@pytest.mark.parametrize("cfg", [MESH, MESH_SP, Config(data_parallel=2, world_size=4,
                                                       query_heads=8, kv_heads=2)],
                         ids=["tp2dp2", "tp2dp2-sp", "tp4dp2-kv-replicas"])
@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
def test_correct_tp_on_a_mesh_passes_all_five(cfg, simulate):
    result = run(11, "equivalence", cfg, simulate)
    assert result["passed"], result


@pytest.mark.parametrize("cfg", [MESH, MESH_SP], ids=["plain", "sp"])
def test_dp_replicas_agree_when_gradients_sync(cfg):
    views = replica_views(mesh_step(cfg, Injection()), cfg)
    for name in views[0]["grads"]:
        assert torch.equal(views[0]["grads"][name], views[1]["grads"][name])
        assert torch.equal(views[0]["weights"][name], views[1]["weights"][name])
    bad = replica_views(mesh_step(cfg, Injection(dp_grad="self")), cfg)
    assert not torch.equal(bad[0]["weights"]["wq"], bad[1]["weights"]["wq"])


def test_mesh_ledger_groups():
    ok = mesh_step(MESH, Injection())["ledger"]
    assert [e["group"] for e in ok if e["group"] != "tp"] == ["dp", "dp"]
    world = mesh_step(MESH, Injection(loss_group="world"))["ledger"]
    assert [e["group"] for e in world if e["group"] != "tp"] == ["dp", "world"]
    tp_only = mesh_step(MESH, Injection(loss_group="tp"))["ledger"]
    assert [e["group"] for e in tp_only if e["group"] != "tp"] == ["dp"]
    self_ = mesh_step(MESH, Injection(dp_grad="self"))["ledger"]
    assert [e["group"] for e in self_ if e["group"] != "tp"] == ["self", "dp"]
    sp = mesh_step(MESH_SP, Injection(sp_group="dp"))["ledger"]
    assert [(e["collective"], e["group"]) for e in sp if e["phase"] == "forward"] == [
        ("all_gather", "dp"), ("reduce_scatter", "tp")]


@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
def test_mesh_modes_fail_where_their_mechanism_says(simulate):
    dense_loss = run(11, "equivalence", MESH, simulate)
    world = run(11, "loss_reduced_over_world", MESH, simulate)
    tp_only = run(11, "loss_full_tensor_tp_only", MESH, simulate)
    self_ = run(11, "dp_grad_group_of_one", MESH, simulate)
    for r in (world, tp_only, self_):
        assert not r["passed"]
    loss_only = [m for m in MEASURES if m != "loss_abs_diff"]
    assert all(world[m] < TOLERANCE for m in loss_only)
    assert all(tp_only[m] < TOLERANCE for m in loss_only)
    assert self_["loss_abs_diff"] < TOLERANCE and self_["forward_max_abs_diff"] < TOLERANCE
    assert self_["parameter_grad_max_abs_diff"] > 1e-3
    # world: the true loss counted TP times; tp: replica 0's own share of the global mean
    x0, target = make_inputs(MESH, 11)
    step = mesh_step(MESH, Injection(loss_group="world"))
    true = float(step["losses"][0]) / MESH.world_size
    assert world["loss_abs_diff"] == pytest.approx((MESH.world_size - 1) * true, rel=1e-5)
    shares = mesh_step(MESH, Injection(loss_group="tp"))["losses"]
    assert float(shares[0]) + float(shares[2]) == pytest.approx(true, rel=1e-5)
    assert tp_only["loss_abs_diff"] == pytest.approx(true - float(shares[0]), rel=1e-5)
    assert dense_loss["passed"]


def test_sp_gather_wrong_group_mixes_replicas():
    result = run(11, "sp_gather_wrong_group", MESH_SP, "ranks")
    assert not result["passed"] and result["forward_max_abs_diff"] > 1e-2
    assert run(11, "equivalence", MESH_SP, "ranks")["passed"]


@pytest.mark.parametrize("mode,cfg,rule", [
    ("loss_reduced_over_world", Config(), "data_parallel >= 2"),
    ("sp_gather_wrong_group", MESH, "sequence_parallel"),
    ("sp_gather_wrong_group", Config(data_parallel=4, world_size=2, sequence_parallel=True,
                                     seq=4), "data_parallel == world_size"),
])
def test_mesh_needs_are_checked(mode, cfg, rule):
    with pytest.raises(ValueError, match=rule):
        zoo.resolve(mode, cfg, strict=True)


def test_mesh_modes_are_registered_mechanism_and_not_plain_tp():
    for name in MESH_MODES + ("sp_gather_wrong_group",):
        entry = zoo.resolve(name)
        if name == "loss_reduced_over_world":  # torchtitan PR 105 fixed a crash (issue 35)
            assert entry.fidelity == "no report" and not entry.citation
        else:
            assert entry.fidelity == "mechanism" and entry.citation
        assert name not in zoo.runnable_modes()


def test_cli_tp_dp(capsys):
    assert main(["--tp", "2", "--dp", "2", "--mode", "dp_grad_group_of_one"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "dp_grad_group_of_one" and not out["passed"]
    assert main(["--list-modes"]) == 0
    names = [m["name"] for m in json.loads(capsys.readouterr().out)]
    assert set(MESH_MODES) <= set(names)
    with pytest.raises(SystemExit) as e:
        main(["--dp", "0"])
    assert e.value.code == 2
