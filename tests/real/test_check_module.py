"""tpattn.real.module_check: the five measures for any module and PyTorch TP plan, on real ranks."""
import pytest
import torch
from torch import nn

from tpattn import Config
from tpattn.check.core import (MEASURES, MISSING_OUTPUT_REDUCE, PARAM_SEED_OFFSET, TOLERANCE,
                          make_inputs)
from tpattn.bugs.modes import run
from tpattn.real.launch import RankFailure
from tpattn.real.module_check import check_module, check_plans

pytestmark = pytest.mark.timeout(300)  # a hang is a failure, not a stuck test run

SEED = 11


def wrong_plans():
    """HF's plan with o_proj's sum left as a partial (the missing g)."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import RowwiseParallel

    from tpattn.interop import llama_tp_plan

    return {**llama_tp_plan(), "layer.self_attn.o_proj": RowwiseParallel(output_layouts=Partial())}


@pytest.fixture(scope="module")
def hf_checks():
    """The HF Llama layer with the seed's weights and inputs, under HF's plan and the wrong one
    (one set of rank processes for both)."""
    pytest.importorskip("transformers")
    from tpattn.interop import LlamaAttentionBlock, llama_layer, llama_tp_plan

    cfg = Config()
    block = LlamaAttentionBlock(llama_layer(cfg, seed=SEED + PARAM_SEED_OFFSET))
    x, target = make_inputs(cfg, SEED)
    correct, wrong = check_plans(block, {"equivalence": llama_tp_plan(),
                                         MISSING_OUTPUT_REDUCE: wrong_plans()}, x, target=target)
    return correct, wrong


def test_hf_plan_on_the_hf_layer_passes_like_the_package(hf_checks):
    correct, _ = hf_checks
    assert correct.passed and correct.measures["passed"]
    ours = run(SEED)  # the package's simulated TP on the same weights and inputs
    for m in MEASURES:
        assert correct.measures[m] < TOLERANCE and ours[m] < TOLERANCE
    # RowwiseParallel sums once in forward; each ColwiseParallel input sums its dn in backward
    assert correct.ledger == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 3}}
    assert set(correct.sharded) == {f"layer.self_attn.{n}_proj.weight" for n in "qkvo"}
    assert correct.sharded["layer.self_attn.o_proj.weight"] == ["S(1)"]
    # after the all-reduces every rank holds the same bits of every replicated tensor
    assert set(correct.replica_disagreement) == {
        "output", "input_grad", "grad:layer.input_layernorm.weight",
        "weight:layer.input_layernorm.weight"}
    assert all(v == 0.0 for v in correct.replica_disagreement.values())


def test_partial_o_proj_is_the_missing_output_reduce_of_real_ranks(hf_checks):
    from tpattn.real.ranks import run_distributed

    _, wrong = hf_checks
    assert not wrong.passed
    assert wrong.ledger["forward"] == {}  # no all-reduce in forward: g is gone
    assert wrong.ledger["backward"] == {"all_reduce": 3}
    assert wrong.measures["forward_max_abs_diff"] > 1e-2
    d = wrong.replica_disagreement
    assert d["output"] > 1e-2 and d["input_grad"] > 1e-3  # each rank its own output
    assert d["grad:layer.input_layernorm.weight"] == d["weight:layer.input_layernorm.weight"] == 0
    # number for number the package's own real-rank run without g (chapter 11), to rounding
    real = run_distributed(2, [SEED], [MISSING_OUTPUT_REDUCE], dtensor=False).results[0]
    for m in MEASURES:
        assert abs(wrong.measures[m] - real[m]) < TOLERANCE


class TwoLayerMLP(nn.Module):
    """x [S, B, 8] -> [S, B, 8]: up (8 -> 16), ReLU, down (16 -> 8)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_any_module_megatron_mlp_passes_and_a_missing_rowwise_is_a_one_line_failure():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(1))
    ok = check_module(TwoLayerMLP(), {"up": ColwiseParallel(), "down": RowwiseParallel()}, x)
    assert ok.passed, ok.measures
    # the bias of the row-parallel layer is replicated: its gradient agrees on every rank
    assert ok.replica_disagreement["grad:down.bias"] == 0.0
    assert ok.ledger["forward"] == {"all_reduce": 1}
    with pytest.raises(RankFailure, match=r"^real-rank run failed: rank [01] raised RuntimeError"):
        check_module(TwoLayerMLP(), {"up": ColwiseParallel()}, x)


def shard_mlp_megatron(module, mesh):
    """A sharding function: Megatron's MLP plan applied by hand (what torchtitan's
    ``parallelize_*`` functions do for a whole model)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    return parallelize_module(module, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def test_a_sharding_function_is_checked_like_the_plan_it_applies():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(1))
    by_plan, by_function = check_plans(
        TwoLayerMLP(), {"plan": {"up": ColwiseParallel(), "down": RowwiseParallel()},
                        "function": shard_mlp_megatron}, x)
    assert by_function.passed and by_function.measures["mode"] == "function"
    assert by_function.ledger == by_plan.ledger and by_function.sharded == by_plan.sharded
    for m in MEASURES:
        assert by_function.measures[m] == by_plan.measures[m]


@pytest.mark.parametrize("kwargs, message", [
    ({"plan": ["up"]}, "must be a non-empty dict of module name -> ParallelStyle, or a "
                       "sharding function"),
    ({"plan": lambda module, mesh: module}, "a sharding function must be picklable"),
    ({"module": "not a module"}, "module must be a torch.nn.Module"),
    ({"plan": {}}, "plan 'plan' must be a non-empty dict"),
    ({"plan": {"up": "colwise"}}, "must map module names to ParallelStyle objects"),
    ({"plan": {"nope": "style"}}, "names modules the module does not have: nope"),
    ({"x": torch.ones(2, dtype=torch.long)}, "x must be a floating-point torch.Tensor"),
    ({"world_size": 1}, "world_size must be an integer >= 2"),
    ({"tolerance": 0}, "tolerance must be a number > 0"),
])
def test_bad_arguments_raise_value_error_naming_the_rule(kwargs, message):
    from torch.distributed.tensor.parallel import ColwiseParallel

    if kwargs.get("plan") == {"nope": "style"}:
        kwargs = {"plan": {"nope": ColwiseParallel()}}
    args = {"module": TwoLayerMLP(), "plan": {"up": ColwiseParallel()}, "x": torch.ones(2, 8),
            **kwargs}
    with pytest.raises(ValueError, match=message):
        check_module(args.pop("module"), args.pop("plan"), args.pop("x"), **args)


WARNING_SCRIPT = """
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from tests.real.test_check_module import TwoLayerMLP
from tpattn.real.module_check import check_module


class WithPositions(TwoLayerMLP):
    # an embedding of positions: a submodule none of whose inputs needs a gradient
    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(3, 8)

    def forward(self, x):
        return super().forward(x) + self.pos(torch.arange(x.shape[0])).unsqueeze(1)


if __name__ == "__main__":
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(1))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    print("passed" if check_module(WithPositions(), plan, x).passed else "failed")
"""


def test_check_module_lets_no_warning_of_its_own_hooks_reach_the_user(tmp_path):
    # the ranks are separate processes: read what they write to stderr
    import os
    import pathlib
    import subprocess
    import sys

    script = tmp_path / "check_positions.py"
    script.write_text(WARNING_SCRIPT)
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root, "PYTHONWARNINGS": "always"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, cwd=root, timeout=240)
    assert done.returncode == 0 and done.stdout.strip() == "passed", done.stderr
    assert "Warning" not in done.stderr, done.stderr
