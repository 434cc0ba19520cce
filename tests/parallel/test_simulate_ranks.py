"""``run(..., simulate="ranks")``: simulated ranks that behave like real ones.

Checked against an independent one-process model of what real ranks do without g (written here
with plain autograd, not with the engine), against the fixture where the two
semantics must agree, and for its per-rank structure. Real ranks are compared in
``test_distributed.py``. Tolerance: ``TOLERANCE`` (1e-6 absolute) between two float32 ways of
summing the same numbers at the seed's size, where rounding differences are ~1e-7.
"""
import pytest
import torch
import torch.nn.functional as F

from tpattn.bugs.zoo import REGISTRY
import tpattn
from tpattn import (EQUIVALENCE, MEASURES, MISSING_INPUT_GRAD_REDUCE, MISSING_OUTPUT_REDUCE,
                    MODES, TOLERANCE, Config)
from tpattn.check.core import (LR, PARAM_SEED_OFFSET, dense_reference,
                          five_measures, make_inputs)
from tpattn.cli import main as cli_main
from tpattn.block.dense import attend_and_project
from tpattn.block.layers import rms_norm
from tpattn.block.params import clone_trainable, init_params, shard_params
from tpattn.parallel.simulated import rank_steps, simulated_step

CFG4 = Config(query_heads=8, kv_heads=4, world_size=4)


def each_rank_trains_on_its_own_output(seed: int, cfg: Config) -> dict:
    """``missing_output_reduce`` as real ranks run it, modelled with plain autograd.

    Without g, rank r's output is ``x + partial_r`` and rank r's own loss drives rank r's
    shard; f still sums every rank's ``dn`` (one shared ``n``: autograd sums its uses).
    Returns rank 0's view as ``run()``'s dict.
    """
    x0, target = make_inputs(cfg, seed)
    base = init_params(cfg, seed + PARAM_SEED_OFFSET)
    p = clone_trainable(base)  # shards are slices: each rank's grads land in its rows
    x_into_norm = x0.clone().requires_grad_(True)
    n = rms_norm(x_into_norm, p["norm"], cfg.eps)
    x_residual = [x0.clone().requires_grad_(True) for _ in range(cfg.world_size)]
    outputs = [x_residual[r] + attend_and_project(n, shard, cfg)
               for r, shard in enumerate(shard_params(p, cfg))]
    losses = [F.mse_loss(y, target) for y in outputs]
    sum(losses).backward()
    tp = {"output": outputs[0].detach(), "loss": losses[0].detach(),
          "input_grad": x_residual[0].grad + x_into_norm.grad,
          "grads": {k: p[k].grad for k in p},
          "weights": {k: (p[k] - LR * p[k].grad).detach() for k in p}}
    return five_measures(seed, MISSING_OUTPUT_REDUCE, dense_reference(x0, target, base, cfg), tp)


@pytest.mark.parametrize("cfg", [Config(), CFG4], ids=["2 ranks", "4 ranks"])
@pytest.mark.parametrize("seed", [3, 11, 29])
def test_missing_g_matches_the_independent_model(seed, cfg):
    ranks = tpattn.run(seed, MISSING_OUTPUT_REDUCE, cfg, simulate="ranks")
    model = each_rank_trains_on_its_own_output(seed, cfg)
    assert ranks["passed"] is model["passed"] is False
    for m in MEASURES:
        assert abs(ranks[m] - model[m]) <= TOLERANCE, (m, ranks[m], model[m])


@pytest.mark.parametrize("seed", [3, 11, 29])
def test_missing_g_gradients_differ_from_the_fixture_view(seed):
    ranks = tpattn.run(seed, MISSING_OUTPUT_REDUCE, simulate="ranks")
    fixture = tpattn.run(seed, MISSING_OUTPUT_REDUCE)
    for m in ("forward_max_abs_diff", "loss_abs_diff"):  # rank 0's own output and loss
        assert abs(ranks[m] - fixture[m]) <= TOLERANCE
    assert abs(ranks["parameter_grad_max_abs_diff"] - fixture["parameter_grad_max_abs_diff"]) > 1e-3


@pytest.mark.parametrize("mode", [EQUIVALENCE, MISSING_INPUT_GRAD_REDUCE])
@pytest.mark.parametrize("cfg", [Config(), CFG4], ids=["2 ranks", "4 ranks"])
def test_where_no_output_is_lost_both_semantics_agree(mode, cfg):
    for seed in (3, 8, 13):
        ranks, fixture = tpattn.run(seed, mode, cfg, "ranks"), tpattn.run(seed, mode, cfg)
        assert ranks["passed"] == fixture["passed"] == (mode == EQUIVALENCE)
        for m in MEASURES:
            assert abs(ranks[m] - fixture[m]) <= TOLERANCE, (seed, m)


def _steps(mode: str, cfg: Config, seed: int = 11):
    x0, target = make_inputs(cfg, seed)
    base = init_params(cfg, seed + PARAM_SEED_OFFSET)
    steps = rank_steps(simulated_step(shard_params(base, cfg), [(x0, target)] * cfg.world_size,
                                      cfg, REGISTRY[mode].injection, LR))
    return x0, base, steps


def test_without_g_each_rank_outputs_its_own_partial():
    cfg = CFG4
    x0, base, steps = _steps(MISSING_OUTPUT_REDUCE, cfg)
    n = rms_norm(x0, base["norm"], cfg.eps)
    for shard, step in zip(shard_params(base, cfg), steps):
        torch.testing.assert_close(step["output"], x0 + attend_and_project(n, shard, cfg),
                                   rtol=0, atol=TOLERANCE)
    # and the ranks' outputs really differ: each trains on a different wrong output
    assert (steps[0]["output"] - steps[1]["output"]).abs().max() > 1e-2


def test_with_both_reductions_every_rank_holds_the_same_bits():
    _, _, steps = _steps(EQUIVALENCE, CFG4)
    for step in steps[1:]:
        assert torch.equal(step["output"], steps[0]["output"])
        assert torch.equal(step["input_grad"], steps[0]["input_grad"])
        assert torch.equal(step["grads"]["norm"], steps[0]["grads"]["norm"])


def test_without_f_the_ranks_copies_of_the_norm_gradient_disagree():
    _, _, steps = _steps(MISSING_INPUT_GRAD_REDUCE, Config())
    assert (steps[0]["grads"]["norm"] - steps[1]["grads"]["norm"]).abs().max() > 1e-3


def test_bad_simulate_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="simulate must be one of fixture, ranks"):
        tpattn.run(11, EQUIVALENCE, simulate="rank")
    with pytest.raises(ValueError, match="simulate must be one of"):
        tpattn.run_matrix(simulate=None)


def test_cli_simulate_ranks_and_bad_value(capsys):
    assert cli_main(["--simulate", "ranks", "--mode", MISSING_OUTPUT_REDUCE]) == 0
    out = capsys.readouterr().out
    assert '"parameter_grad_max_abs_diff"' in out
    with pytest.raises(SystemExit) as e:
        cli_main(["--simulate", "bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--simulate" in err


def test_kv_replica_groups_are_the_ranks_sharing_a_kv_head_in_every_tp_group():
    from tpattn.config import Config
    from tpattn.block.kv_layout import replica_groups
    from tpattn.parallel.collectives import SimulatedRanks

    cfg = Config(world_size=4, query_heads=4, kv_heads=2, data_parallel=2)
    groups = SimulatedRanks(cfg).groups("kv_replicas")
    assert groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups[:2] == replica_groups(cfg)
    assert SimulatedRanks(cfg).groups("self") == [[i] for i in range(8)]
    with pytest.raises(ValueError, match="group must be"):
        SimulatedRanks(cfg).groups("pp")
