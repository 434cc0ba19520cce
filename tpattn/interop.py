"""The book's block is Hugging Face's Llama attention: parameters both ways (HF is batch-first
``[B, S, hidden]``), Meta's adjacent-pair RoPE rows, and Megatron's fused QKV interleaved per KV
group. Importing this module imports ``transformers``; ``import tpattn`` does not."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tpattn.config import Config
from tpattn.block.layers import attention, causal_mask, repeat_kv, rms_norm, rope_angles
from tpattn.block.fused_qkv import (fuse_qkv_weight, fused_qkv_rows, read_rank_qkv,
                                    split_qkv_weight)
from tpattn.block.params import PARAM_NAMES, init_params

__all__ = ["ROPE_THETA", "llama_config", "config_from_llama", "llama_layer", "llama_params",
           "load_llama_params", "LlamaAttentionBlock", "llama_tp_plan",
           "rotate_half_from_adjacent", "adjacent_from_rotate_half", "apply_rope_adjacent",
           "meta_dense_forward", "QKV_LAYOUTS", "fuse_qkv", "concat_qkv", "split_fused_qkv",
           "read_rank_slices", "float32_tolerance"]

#: The RoPE base of ``rope_angles`` and HF's default; another ``rope_theta`` is refused.
ROPE_THETA = 10000.0


def float32_tolerance(cfg: Config, scale: float) -> float:
    """How far two correct float32 computations of the block may differ: ``n u`` of its chain
    of dot products (``hidden + seq + query_heads * head_dim``) times ``scale`` (at least 1)."""
    u = torch.finfo(torch.float32).eps / 2
    return u * (cfg.hidden + cfg.seq + cfg.query_heads * cfg.head_dim) * max(1.0, float(scale))


#: HF module names of the block's parameters, by the package's names.
_HF_NAMES = {"norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
             "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
             "wo": "self_attn.o_proj.weight"}


def llama_config(cfg: Config, attn_implementation: str = "sdpa") -> LlamaConfig:
    """A one-layer ``LlamaConfig`` whose attention is ``cfg``'s block (the MLP unused)."""
    return LlamaConfig(
        hidden_size=cfg.hidden, num_attention_heads=cfg.query_heads,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.eps,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        attention_bias=False, intermediate_size=1, num_hidden_layers=1, vocab_size=1,
        max_position_embeddings=max(cfg.seq, 1), bos_token_id=None, eos_token_id=None,
        pad_token_id=None, attn_implementation=attn_implementation)


def config_from_llama(hf: LlamaConfig, *, seq: int, batch: int, world_size: int = 1,
                      dtype=torch.float32) -> Config:
    """The ``Config`` of a ``LlamaConfig``'s attention (no biases, default RoPE) and the run's."""
    if getattr(hf, "attention_bias", False):
        raise ValueError("attention_bias must be False: the package's block has no biases")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default" or \
            float(rope.get("rope_theta", ROPE_THETA)) != ROPE_THETA:
        raise ValueError(f"rope_parameters must be the default RoPE with rope_theta={ROPE_THETA} "
                         f"(tpattn.block.layers.apply_rope's base; got {rope})")
    return Config(seq=seq, batch=batch, hidden=hf.hidden_size, query_heads=hf.num_attention_heads,
                  kv_heads=hf.num_key_value_heads, head_dim=hf.head_dim, world_size=world_size,
                  eps=float(hf.rms_norm_eps), dtype=dtype)


def llama_layer(cfg: Config, seed: int = 0, attn_implementation: str = "sdpa") -> LlamaDecoderLayer:
    """An HF ``LlamaDecoderLayer`` for ``cfg`` with ``init_params(cfg, seed)`` (no download)."""
    with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG
        layer = LlamaDecoderLayer(llama_config(cfg, attn_implementation), layer_idx=0)
    layer = layer.to(cfg.torch_dtype)
    return load_llama_params(layer, init_params(cfg, seed))


def llama_params(layer: LlamaDecoderLayer, *, seq: int, batch: int,
                 world_size: int = 1) -> tuple[Config, dict[str, torch.Tensor]]:
    """``(cfg, params)`` of an HF ``LlamaDecoderLayer``'s attention half: detached copies in the
    package's names (same ``[out, in]`` layouts), ``cfg`` with the run's sizes."""
    weight = layer.self_attn.q_proj.weight
    cfg = config_from_llama(layer.self_attn.config, seq=seq, batch=batch,
                            world_size=world_size, dtype=weight.dtype)
    state = layer.state_dict()
    return cfg, {name: state[_HF_NAMES[name]].detach().clone() for name in PARAM_NAMES}


def load_llama_params(layer: LlamaDecoderLayer, params: dict[str, torch.Tensor]) -> LlamaDecoderLayer:
    """Copy ``params`` into ``layer``'s attention half in place; returns ``layer``."""
    state = layer.state_dict()
    for name in PARAM_NAMES:
        have, want = tuple(params[name].shape), tuple(state[_HF_NAMES[name]].shape)
        if have != want:
            raise ValueError(f"params[{name!r}] must have the shape of {_HF_NAMES[name]} "
                             f"{list(want)} (got {list(have)})")
    with torch.no_grad():
        for name in PARAM_NAMES:
            layer.get_parameter(_HF_NAMES[name]).copy_(params[name])
    return layer


class LlamaAttentionBlock(nn.Module):
    """``x + self_attn(input_layernorm(x))`` of an HF ``LlamaDecoderLayer`` (``self.layer``),
    causal, no cache; x ``[S, B, hidden]`` in and out (HF runs ``[B, S, hidden]``)."""

    def __init__(self, layer: LlamaDecoderLayer):
        super().__init__()
        self.layer = layer
        self.rotary = LlamaRotaryEmbedding(layer.self_attn.config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(0, 1)                                       # [B, S, hidden]
        seq = h.shape[1]
        positions = torch.arange(seq, device=h.device).unsqueeze(0)
        cos_sin = self.rotary(h, positions)
        # an explicit additive causal mask: every HF attention implementation honours it
        # (with no mask, "sdpa" is causal but "eager" would not be)
        mask = torch.zeros(seq, seq, dtype=h.dtype, device=h.device).masked_fill(
            causal_mask(seq, device=h.device), float("-inf")).view(1, 1, seq, seq)
        out, _ = self.layer.self_attn(self.layer.input_layernorm(h),
                                      position_embeddings=cos_sin, attention_mask=mask)
        return (h + out).transpose(0, 1)


def llama_tp_plan() -> dict:
    """HF's ``base_model_tp_plan`` attention entries as styles under ``LlamaAttentionBlock``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {}
    for pattern, style in LlamaConfig.base_model_tp_plan.items():
        if pattern.startswith("layers.*.self_attn."):
            if style not in styles:
                raise ValueError(f"base_model_tp_plan[{pattern!r}] must be 'colwise' or "
                                 f"'rowwise' here (got {style!r})")
            plan["layer." + pattern.removeprefix("layers.*.")] = styles[style]()
    return plan


def _check_rows(w: torch.Tensor, heads: int) -> int:
    if w.dim() != 2 or heads < 1 or w.shape[0] % heads or (w.shape[0] // heads) % 2:
        raise ValueError(f"w must be [heads * head_dim, hidden] with head_dim even "
                         f"(got shape {list(w.shape)} for heads={heads})")
    return w.shape[0] // heads


def rotate_half_from_adjacent(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of ``wq``/``wk`` ``[heads * D, hidden]`` from Meta's adjacent pairs ``(2j, 2j+1)``
    to rotate-half's ``(j, j + D/2)`` (HF's ``permute``); a new tensor."""
    d = _check_rows(w, heads)
    return w.reshape(heads, d // 2, 2, -1).transpose(1, 2).reshape(w.shape).clone()


def adjacent_from_rotate_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``rotate_half_from_adjacent``; ``[heads * D, hidden]``."""
    d = _check_rows(w, heads)
    return w.reshape(heads, 2, d // 2, -1).transpose(1, 2).reshape(w.shape).clone()


def apply_rope_adjacent(x: torch.Tensor) -> torch.Tensor:
    """RoPE with Meta's pairing: channels ``(2i, 2i+1)`` one complex number times
    ``exp(1j * angle)`` (``rope_angles``). x: ``[S, B, H, D]``; returns ``[S, B, H, D]``."""
    theta = rope_angles(x.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    rotated = pairs * torch.polar(torch.ones_like(theta), theta)
    return torch.view_as_real(rotated).flatten(-2)


def meta_dense_forward(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    """``dense_forward`` with Meta's adjacent-pair RoPE, for weights in Meta's layout.
    x: ``[S, B, hidden]``; returns ``[S, B, hidden]``."""
    s, b, d = x.shape[0], x.shape[1], cfg.head_dim
    n = rms_norm(x, p["norm"], cfg.eps)
    q = apply_rope_adjacent(F.linear(n, p["wq"]).view(s, b, -1, d))
    k = apply_rope_adjacent(F.linear(n, p["wk"]).view(s, b, -1, d))
    v = F.linear(n, p["wv"]).view(s, b, -1, d)
    ctx = attention(q, repeat_kv(k, cfg.group_size), repeat_kv(v, cfg.group_size))
    return x + F.linear(ctx.reshape(s, b, -1), p["wo"])


#: Layouts of a fused QKV weight: Megatron's per-group interleaving, and plain ``[Wq; Wk; Wv]``.
QKV_LAYOUTS = ("interleaved", "concatenated")


def fuse_qkv(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Megatron's fused QKV weight ``[(Hq + 2*Hkv)*D, hidden]``: per KV group its query heads'
    rows, then its key head's, then its value head's."""
    return fuse_qkv_weight(wq, wk, wv, cfg, "grouped")


def concat_qkv(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The naive fused weight ``[Wq; Wk; Wv]``: ``[(Hq + 2*Hkv)*D, hidden]``."""
    return fuse_qkv_weight(wq, wk, wv, cfg, "plain")


def split_fused_qkv(w: torch.Tensor, cfg: Config, layout: str = "interleaved"):
    """``(wq, wk, wv)`` of ``fuse_qkv``'s (``"interleaved"``) or ``concat_qkv``'s weight."""
    if layout not in QKV_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(QKV_LAYOUTS)} (got {layout!r})")
    parts = split_qkv_weight(w, cfg, "plain" if layout == "concatenated" else "grouped")
    return tuple(t.clone() for t in parts)


def read_rank_slices(w: torch.Tensor, cfg: Config):
    """``(wq, wk, wv)`` the ranks hold when each reads a contiguous ``1/W`` of ``w``'s rows as
    its KV groups ``[q × g, k, v]`` (Megatron): ``fuse_qkv``'s weight back, not ``concat_qkv``'s."""
    if tuple(w.shape) != (fused_qkv_rows(cfg), cfg.hidden):
        raise ValueError(f"w must be [(query_heads + 2*kv_heads)*head_dim, hidden] = "
                         f"{[fused_qkv_rows(cfg), cfg.hidden]} (got {list(w.shape)})")
    parts = [read_rank_qkv(chunk, cfg, "grouped") for chunk in w.chunk(cfg.world_size)]
    return tuple(torch.cat([part[i] for part in parts]) for i in range(3))
