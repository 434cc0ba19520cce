"""A stack of blocks: one block is the fixture; in a stack, a missing f reaches every lower block."""
import pytest
import torch

import tpattn
from tpattn.bugs.modes import resolve
from tpattn.check import stack
from tpattn.block.params import PARAM_NAMES

SHARDED = ("wq", "wk", "wv", "wo")


@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
@pytest.mark.parametrize("mode", tpattn.MODES)
@pytest.mark.parametrize("seed", tpattn.SEEDS)
def test_a_stack_of_one_block_is_the_fixture(seed, mode, simulate):
    one = stack.run_stack(seed, resolve(mode), layers=1, simulate=simulate)
    fixture = tpattn.run(seed, mode, simulate=simulate)
    for m in ("forward_max_abs_diff", "loss_abs_diff", "input_grad_max_abs_diff"):
        assert one[m] == fixture[m]  # the same computation, so the same floats
    assert max(one["grad_diffs"][0].values()) == fixture["parameter_grad_max_abs_diff"]
    assert max(one["weight_diffs"][0].values()) == fixture["post_step_weight_max_abs_diff"]


@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
@pytest.mark.parametrize("seed", tpattn.SEEDS)
def test_correct_tp_stack_equals_the_dense_stack(seed, simulate):
    r = stack.run_stack(seed, resolve(tpattn.EQUIVALENCE), layers=3, simulate=simulate)
    assert r["forward_max_abs_diff"] < tpattn.TOLERANCE and r["loss_abs_diff"] < tpattn.TOLERANCE
    assert r["input_grad_max_abs_diff"] < tpattn.TOLERANCE
    for diffs in (*r["grad_diffs"], *r["weight_diffs"]):
        assert max(diffs.values()) < tpattn.TOLERANCE


@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
@pytest.mark.parametrize("layers", [2, 3, 4])
@pytest.mark.parametrize("seed", tpattn.SEEDS)
def test_missing_f_in_a_stack_corrupts_every_lower_block(seed, layers, simulate):
    r = stack.run_stack(seed, resolve(tpattn.MISSING_INPUT_GRAD_REDUCE), layers=layers, simulate=simulate)
    # forward and loss untouched, as in one block
    assert r["forward_max_abs_diff"] < tpattn.TOLERANCE and r["loss_abs_diff"] < tpattn.TOLERANCE
    top, lower = r["grad_diffs"][-1], r["grad_diffs"][:-1]
    # the top block is chapter 9's one block: only norm wrong
    assert top["norm"] > 1e-4 and all(top[name] < tpattn.TOLERANCE for name in SHARDED)
    # every block below it gets a wrong upstream gradient: every parameter wrong after one step
    for block in lower:
        assert all(block[name] > 1e-4 for name in PARAM_NAMES), block
    for block in r["weight_diffs"][:-1]:
        assert all(block[name] > 1e-6 for name in PARAM_NAMES), block


@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
def test_missing_g_in_a_stack_fails_everywhere(simulate):
    r = stack.run_stack(11, resolve(tpattn.MISSING_OUTPUT_REDUCE), layers=3, simulate=simulate)
    assert r["forward_max_abs_diff"] > 1e-2
    assert all(min(block.values()) > 1e-4 for block in r["grad_diffs"])


def test_blocks_are_the_flat_tensors_and_block_zero_is_the_fixture():
    cfg = tpattn.Config()
    flat = stack.init_stack(cfg, 3, 111)
    blocks = stack.blocks_of(flat)
    assert len(blocks) == 3 and all(set(b) == set(PARAM_NAMES) for b in blocks)
    assert all(blocks[l][n] is flat[f"{l}.{n}"] for l in range(3) for n in PARAM_NAMES)
    fixture = tpattn.init_params(cfg, 111)
    assert all(torch.equal(blocks[0][n], fixture[n]) for n in PARAM_NAMES)
    assert not torch.equal(blocks[0]["wq"], blocks[1]["wq"])  # each block its own weights


@pytest.mark.parametrize("layers", [0, -1, 1.5, True, "2"])
def test_bad_layers_is_a_value_error_naming_the_field(layers):
    with pytest.raises(ValueError, match="layers must be an integer >= 1"):
        stack.run_stack(11, resolve(tpattn.EQUIVALENCE), layers=layers)


def test_bad_mode_and_seed_are_value_errors():
    with pytest.raises(ValueError, match="program must be a registry entry of the original fixture's check"):
        stack.run_stack(11, "nope")  # a name, not its entry
    with pytest.raises(ValueError, match="program must be a registry entry of the original fixture's check"):
        stack.run_stack(11, resolve("output_reduced_twice"))  # not tp_forward's program
    with pytest.raises(ValueError, match="seed must be"):
        stack.run_stack(-1, resolve(tpattn.EQUIVALENCE))
    with pytest.raises(ValueError, match="simulate must be one of"):
        stack.run_stack(11, resolve(tpattn.EQUIVALENCE), simulate="real")


def test_ranks_and_fixture_agree_where_rank_0_sees_everything():
    """Without f, rank 0's own chain of upstream gradients is the fixture's: the stack's dX and
    the top block agree; below it rank 1's shards differ (they follow rank 1's own dX)."""
    fixture = stack.run_stack(11, resolve(tpattn.MISSING_INPUT_GRAD_REDUCE), layers=3)
    ranks = stack.run_stack(11, resolve(tpattn.MISSING_INPUT_GRAD_REDUCE), layers=3, simulate="ranks")
    assert abs(fixture["input_grad_max_abs_diff"] - ranks["input_grad_max_abs_diff"]) < 1e-6
    assert all(abs(fixture["grad_diffs"][-1][k] - ranks["grad_diffs"][-1][k]) < 1e-6
               for k in PARAM_NAMES)
    assert any(abs(fixture["grad_diffs"][0][k] - ranks["grad_diffs"][0][k]) > 1e-4
               for k in SHARDED)


def test_train_stack_depth_turns_a_quiet_loss_curve_into_a_visible_gap():
    from tpattn.check.stack import train_stack

    def gap(layers, simulate, steps=20):
        bug = train_stack(11, resolve("missing_input_grad_reduce"), layers=layers, steps=steps,
                          simulate=simulate)
        good = train_stack(11, resolve("equivalence"), layers=layers, steps=steps, simulate=simulate)
        assert bug["losses"][0] == good["losses"][0]          # the forward is untouched
        return abs(bug["losses"][-1] - good["losses"][-1]) / good["losses"][-1], bug, good

    one, bug, good = gap(1, "fixture")
    assert one < 1e-2 and max(bug["norm_spread"]) == 0       # one copy of norm
    four, _, _ = gap(4, "fixture")
    assert four > 5 * one                                     # depth makes it visible
    ranks, bug, good = gap(1, "ranks")
    assert ranks < 1e-2
    assert bug["norm_spread"][-1] > 1e-2 and max(good["norm_spread"]) == 0
