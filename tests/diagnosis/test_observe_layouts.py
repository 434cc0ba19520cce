"""``tpattn.observe`` on the registry modes that need a layout: the sequence-parallel norm
gradient (``missing_norm_grad_reduce``, ``norm_grad_averaged``) and the KV replica-group
reduce (``missing_kv_grad_reduce``).

Each bug must show where its mechanism says, and nowhere else: a dropped collective in the
ledger, replicas that drift apart, the gradient norm of the parameter it touches. Tolerances:
a ratio the mechanism fixes exactly (1/W) is checked to 1e-5 relative (float32 rounding of
the same sums is ~1e-7 relative); "untouched" gradients to the same 1e-5; "touched" means
off by more than 1e-3 relative (the bugs move them by percents). Losses of one forward on the
same numbers are compared to 1e-6 relative.
"""
import json

import pytest

import tpattn
from tpattn import Config
from tpattn.bugs import zoo
from tpattn.cli import main as cli_main
from tpattn.diagnosis.observe import STEPS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SP = Config(seq=8, sequence_parallel=True)
SP_W4 = Config(seq=8, query_heads=8, kv_heads=4, world_size=4, sequence_parallel=True)
KV = Config(query_heads=8, kv_heads=2, world_size=4)
KV_MQA = Config(query_heads=4, kv_heads=1, world_size=2)
LAYOUT_MODES = {"missing_norm_grad_reduce": (SP, SP_W4), "norm_grad_averaged": (SP, SP_W4),
                "missing_kv_grad_reduce": (KV, KV_MQA)}
SEEDS = (3, 7)


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def sharded_ratios_are_one(obs, names):
    return all(rel(obs["grad_norm_ratio"][k], 1.0) <= 1e-5 for k in names)


def test_list_modes_says_runnable_and_observable(capsys):
    assert cli_main(["--list-modes"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    for mode in LAYOUT_MODES:
        assert listed[mode]["runnable"] is True and listed[mode]["observable"] is True


@pytest.mark.parametrize("mode", list(LAYOUT_MODES))
def test_observe_runs_on_a_config_that_meets_the_needs(mode):
    for cfg in LAYOUT_MODES[mode]:
        for seed in SEEDS:
            obs = tpattn.observe(mode, seed, cfg)
            assert json.loads(json.dumps(obs)) == obs
            w = cfg.world_size
            assert len(obs["rank_losses"]) == len(obs["batch_checksums"]) == w
            # the forward is right: the step-0 losses agree and equal the good run's
            assert all(rel(l, obs["reference"]["rank_losses"][0]) <= 1e-6
                       for l in obs["rank_losses"])
            assert len(set(obs["batch_checksums"])) == 1  # every rank loaded one batch
            assert len(obs["loss_curve"]) == STEPS
            # the diagnosis runs (what it names is measured elsewhere)
            diagnosis = tpattn.diagnose(obs)
            assert diagnosis and all(isinstance(c["cause"], str) for c in diagnosis)


@pytest.mark.parametrize("cfg", [SP, SP_W4], ids=["W2", "W4"])
def test_a_dropped_norm_gradient_reduce_shows_in_the_ledger_replicas_and_norm_gradient(cfg):
    obs = tpattn.observe("missing_norm_grad_reduce", 11, cfg)
    after = [e for e in obs["planned_ledger"] if e["phase"] == "after backward"]
    assert len(after) == 1  # the plan all-reduces the norm weight's gradient once
    assert obs["ledger"] == [e for e in obs["planned_ledger"] if e["phase"] != "after backward"]
    norm = obs["replica_checksums"]["after_1"]["norm"]
    assert len(set(norm)) == cfg.world_size  # each rank stepped with its own tokens' share
    assert rel(obs["grad_norm_ratio"]["norm"], 1.0) > 1e-3
    assert sharded_ratios_are_one(obs, ("wq", "wk", "wv", "wo"))


@pytest.mark.parametrize("cfg", [SP, SP_W4], ids=["W2", "W4"])
def test_an_averaged_norm_gradient_is_one_over_w_and_an_avg_in_the_ledger(cfg):
    obs = tpattn.observe("norm_grad_averaged", 11, cfg)
    # the same collectives as the plan, but the norm gradient's all-reduce asks for AVG
    differ = [(e, p) for e, p in zip(obs["ledger"], obs["planned_ledger"]) if e != p]
    assert len(obs["ledger"]) == len(obs["planned_ledger"]) and len(differ) == 1
    (seen, planned), = differ
    assert seen == {**planned, "op": "avg"} and planned["phase"] == "after backward"
    assert rel(obs["grad_norm_ratio"]["norm"], 1 / cfg.world_size) <= 1e-5
    assert sharded_ratios_are_one(obs, ("wq", "wk", "wv", "wo"))
    for when in ("after_1", "after_k"):  # every rank gets the same (wrong) average
        assert len(set(obs["replica_checksums"][when]["norm"])) == 1
    # the weights move differently from the good run's: the curve leaves it by step 2
    assert rel(obs["loss_curve"][-1], obs["reference"]["loss_curve"][-1]) > 1e-6


@pytest.mark.parametrize("cfg", [KV, KV_MQA], ids=["2 KV heads on 4", "MQA on 2"])
def test_a_dropped_kv_grad_reduce_splits_the_wk_wv_replicas(cfg):
    obs = tpattn.observe("missing_kv_grad_reduce", 11, cfg)
    replica_reduce = [e for e in obs["planned_ledger"] if e["group"] == "kv_replicas"]
    assert replica_reduce and all(e["phase"] == "backward" for e in replica_reduce)
    assert obs["ledger"] == [e for e in obs["planned_ledger"] if e["group"] != "kv_replicas"]
    after_1 = obs["replica_checksums"]["after_1"]
    groups = [k for k in after_1 if k.startswith(("wk (", "wv ("))]
    assert len(groups) == 2 * cfg.kv_heads
    assert all(len(set(after_1[k])) == cfg.kv_replicas for k in groups)  # copies drift apart
    assert len(set(after_1["norm"])) == 1
    assert rel(obs["grad_norm_ratio"]["wk"], 1.0) > 1e-3
    assert rel(obs["grad_norm_ratio"]["wv"], 1.0) > 1e-3
    assert sharded_ratios_are_one(obs, ("norm", "wq", "wo"))


@pytest.mark.parametrize("cfg", [SP, SP_W4, KV, KV_MQA], ids=["SP", "SP W4", "KV", "MQA"])
def test_the_correct_program_on_each_layout_deviates_nowhere(cfg):
    obs = tpattn.observe(tpattn.EQUIVALENCE, 11, cfg)
    assert obs["ledger"] == obs["planned_ledger"]
    for when in ("after_1", "after_k"):  # replicas, the KV groups' included, stay identical
        assert all(len(set(v)) == 1 for v in obs["replica_checksums"][when].values())
    assert tpattn.diagnose(obs)[0]["evidence"] == ["nothing deviates from a correct run"]


def test_the_good_twins_loss_curve_is_the_global_mse_under_sp():
    """The good twin's loss curve is the one the correct run logs (the global MSE)."""
    bug = tpattn.observe("norm_grad_averaged", 11, SP)
    good = tpattn.observe(tpattn.EQUIVALENCE, 11, SP)
    assert all(rel(a, b) <= 1e-6 for a, b in zip(bug["reference"]["loss_curve"],
                                                 good["loss_curve"]))


@pytest.mark.parametrize("mode, cfg, rule", [
    ("missing_norm_grad_reduce", Config(), "needs sequence_parallel=True"),
    ("norm_grad_averaged", KV, "needs sequence_parallel=True"),
    ("missing_kv_grad_reduce", Config(), "kv_heads < world_size .*kv_heads=2, world_size=2"),
    ("missing_kv_grad_reduce", Config(query_heads=8, kv_heads=2, world_size=4,
                                      kv_strategy="gather_activations"),
     "kv_strategy='replicate_weights'"),
    ("missing_kv_grad_reduce", SP, "kv_heads < world_size"),
])
def test_a_config_that_misses_the_needs_is_a_value_error_naming_the_rule(mode, cfg, rule):
    with pytest.raises(ValueError, match=rule) as e:
        tpattn.observe(mode, 11, cfg)
    assert "not part of this build" not in str(e.value) and "cannot watch" not in str(e.value)
    with pytest.raises(ValueError, match=rule):
        zoo.resolve(mode, cfg, strict=True)
