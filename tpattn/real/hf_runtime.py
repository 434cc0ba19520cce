"""Hugging Face's own tensor-parallel runtime as a sharding function for ``check_module``:
``save_pretrained`` on rank 0, ``from_pretrained(tp_plan=..., device_mesh=mesh)`` on every rank.
Needs ``transformers`` and ``accelerate``; downloads nothing."""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import torch

__all__ = ["CausalLMLogits", "hf_tp_runtime", "tiny_causal_lm"]


class CausalLMLogits(torch.nn.Module):
    """``lm`` (a Hugging Face causal LM) as ``x`` ``[B, S, hidden]`` (``inputs_embeds``) ->
    logits ``[B, S, vocab]``, without a KV cache."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(inputs_embeds=x, use_cache=False).logits


def tiny_causal_lm(kind: str, seed: int = 0, **sizes) -> CausalLMLogits:
    """A small float32 causal LM from its config, weights from ``seed``: ``kind`` ``"llama"``
    or ``"qwen3"``; 2 layers, hidden 64, 8 query / 4 KV heads of 8, MLP 128, vocab 128
    (``sizes`` overrides config fields)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    configs = {"llama": LlamaConfig, "qwen3": Qwen3Config}
    if kind not in configs:
        raise ValueError(f"kind must be one of {', '.join(configs)} (got {kind!r})")
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=8, **sizes)
    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(configs[kind](**fields), dtype=torch.float32)
    return CausalLMLogits(lm.eval())


def _quiet_transformers() -> None:
    """No progress bars or advice from ``transformers`` on the ranks."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module="transformers")


def hf_tp_runtime(module: CausalLMLogits, mesh, tp_plan="auto") -> CausalLMLogits:
    """``module`` sharded over the 1-D ``mesh`` by Hugging Face's runtime, on every rank;
    ``tp_plan``: ``"auto"`` (the model's own plan), or overrides merged into it."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    if not isinstance(module, CausalLMLogits):
        raise ValueError(f"module must be a CausalLMLogits (got {type(module).__name__})")
    _quiet_transformers()
    name = [tempfile.mkdtemp(prefix="tpattn-hf-") if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        module.lm.save_pretrained(name[0])
    dist.broadcast_object_list(name, src=0)
    for var, value in (("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size()),
                       ("LOCAL_RANK", dist.get_rank())):
        os.environ.setdefault(var, str(value))
    lm = AutoModelForCausalLM.from_pretrained(name[0], dtype=torch.float32, tp_plan=tp_plan,
                                              device_mesh=mesh)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(name[0], ignore_errors=True)
    return CausalLMLogits(lm.eval())
