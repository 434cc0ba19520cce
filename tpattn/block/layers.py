"""The block's layers as functions: RMSNorm, RoPE, GQA, causal attention; ``[S, B, H, D]``."""
from __future__ import annotations

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dim: x ``[..., hidden]``,
    weight ``[hidden]``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_angles(seq: int, head_dim: int, dtype=torch.float32, device=None,
                offset: int = 0) -> torch.Tensor:
    """The angle of channel pair ``i`` at position ``m``: ``m / 10000**(i / (head_dim/2))``,
    positions ``offset .. offset + seq - 1``; ``[S, 1, 1, head_dim // 2]``."""
    half = head_dim // 2
    pos = torch.arange(offset, offset + seq, dtype=dtype, device=device).view(seq, 1, 1, 1)
    freq = torch.arange(half, dtype=dtype, device=device).view(1, 1, 1, half)
    return pos / (10000.0 ** (freq / max(1, half)))


def apply_rope(x: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Rotary embedding, rotate-half: channel ``i`` paired with ``i + D/2``, row ``s`` at
    position ``offset + s``. x: ``[S, B, H, D]``, D even; returns ``[S, B, H, D]``."""
    # bfloat16 cannot hold the angles: compute them in float32, round only cos/sin
    angle_dtype = torch.float32 if x.dtype == torch.bfloat16 else x.dtype
    theta = rope_angles(x.shape[0], x.shape[-1], dtype=angle_dtype, device=x.device, offset=offset)
    cos, sin = theta.cos().to(x.dtype), theta.sin().to(x.dtype)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: each KV head repeated for its ``groups`` query heads (query head ``h`` reads KV
    head ``h // groups``). x: ``[S, B, Hkv, D]``; returns ``[S, B, Hkv * groups, D]``."""
    return x.repeat_interleave(groups, dim=2)


def causal_mask(seq: int, device=None) -> torch.Tensor:
    """``[S, S]`` bool, ``True`` where query ``s`` must not see key ``t`` (``t > s``)."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)


def attention_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal softmax weights: q, k ``[S, B, H, D]`` -> ``[B, H, S, S]``."""
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(q.shape[-1])
    mask = causal_mask(q.shape[0], device=q.device)
    scores = scores.masked_fill(mask.view(1, 1, *mask.shape), float("-inf"))
    return scores.softmax(-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              drop: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention: q, k, v ``[S, B, H, D]`` -> context ``[S, B, H, D]``; ``drop``: a
    dropout mask ``[B, H, S, S]`` multiplied into the probabilities, or ``None``."""
    probs = attention_probs(q, k)
    if drop is not None:
        probs = probs * drop
    return torch.einsum("bhst,tbhd->sbhd", probs, v)
