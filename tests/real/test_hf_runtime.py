"""Hugging Face's own TP runtime under check_module (tpattn.real.hf_runtime), on gloo ranks."""
import functools

import pytest
import torch

from tpattn.check.core import TOLERANCE
from tpattn.real.module_check import check_plans

pytestmark = pytest.mark.timeout(300)

#: Qwen3's q/k norms with HF's "replicate" style: every rank keeps the whole weight, and no
#: hook sums the rank's partial gradient (its own heads) over the ranks.
NORMS_NOT_REDUCED = {"model.layers.*.self_attn.q_norm": "replicate",
                     "model.layers.*.self_attn.k_norm": "replicate"}


@pytest.fixture(scope="module")
def checks():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tpattn.real.hf_runtime import hf_tp_runtime, tiny_causal_lm

    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(1))
    llama, = check_plans(tiny_causal_lm("llama"), {"hf": hf_tp_runtime}, x)
    qwen3, broken = check_plans(
        tiny_causal_lm("qwen3"),
        {"hf": hf_tp_runtime,
         "norms": functools.partial(hf_tp_runtime, tp_plan=NORMS_NOT_REDUCED)}, x)
    return llama, qwen3, broken


def test_hf_runtime_matches_the_unsharded_llama_and_qwen3(checks):
    llama, qwen3, _ = checks
    for check in (llama, qwen3):
        assert check.passed, check.measures
        assert not any(check.replica_disagreement.values())
        # HF's own styles: the LM head gathers its output, o_proj/down_proj sum theirs
        assert check.ledger["forward"] == {"all_gather_into_tensor": 1, "all_reduce": 4}
        assert check.sharded["lm.lm_head.weight"] == ["S(0)"]
    # replicated_with_grad_allreduce: one more backward all-reduce per q/k norm weight
    assert qwen3.ledger["backward"]["all_reduce"] == llama.ledger["backward"]["all_reduce"] + 4


def test_an_hf_plan_without_the_norm_grad_sum_fails_on_the_gradients(checks):
    _, qwen3, broken = checks
    assert not broken.passed
    m = broken.measures
    assert m["forward_max_abs_diff"] < TOLERANCE and m["loss_abs_diff"] < TOLERANCE
    assert m["parameter_grad_max_abs_diff"] > 10 * TOLERANCE
    drifting = {k for k, v in broken.replica_disagreement.items() if v}
    assert drifting == {f"{kind}:lm.model.layers.{i}.self_attn.{n}_norm.weight"
                        for kind in ("grad", "weight") for i in (0, 1) for n in "qk"}
    assert broken.ledger["backward"]["all_reduce"] == qwen3.ledger["backward"]["all_reduce"] - 4
