"""The block's layers, as plain functions on tensors: RMSNorm, RoPE, GQA, causal attention.

Layout is sequence-first, ``[S, B, H, D]`` (seq, batch, heads, head_dim), as in Megatron.
"""
from __future__ import annotations

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square normalization over the last dimension.

    ``y = x / sqrt(mean(x**2) + eps) * weight``

    x: ``[..., hidden]``; weight: ``[hidden]``; returns ``[..., hidden]``.
    """
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_angles(seq: int, head_dim: int, dtype=torch.float32, device=None,
                offset: int = 0) -> torch.Tensor:
    """Rotation angle of channel pair ``i`` at position ``m``: ``m / 10000**(i / (head_dim/2))``.

    Positions are ``offset, offset + 1, ..., offset + seq - 1`` (``offset`` > 0: a slice of a
    longer sequence, e.g. one rank's tokens under sequence parallelism).
    Returns ``[S, 1, 1, head_dim // 2]``, ready to broadcast over ``[S, B, H, head_dim // 2]``.
    """
    half = head_dim // 2
    pos = torch.arange(offset, offset + seq, dtype=dtype, device=device).view(seq, 1, 1, 1)
    freq = torch.arange(half, dtype=dtype, device=device).view(1, 1, 1, half)
    return pos / (10000.0 ** (freq / max(1, half)))


def apply_rope(x: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Rotary position embedding, rotate-half layout.

    Channel ``i`` is paired with channel ``i + D/2``; the pair at position ``m`` is rotated by
    the angle ``rope_angles(S, D)[m, i]``. Row ``s`` of ``x`` is position ``offset + s``
    (default 0: ``x`` starts the sequence).

    x: ``[S, B, H, D]`` with ``D`` even; returns ``[S, B, H, D]``.
    """
    # bfloat16 cannot hold the angles (spacing 0.25 rad at position 32): compute
    # them in float32 and round only cos/sin to x's dtype. float32/float64 are unchanged.
    angle_dtype = torch.float32 if x.dtype == torch.bfloat16 else x.dtype
    theta = rope_angles(x.shape[0], x.shape[-1], dtype=angle_dtype, device=x.device, offset=offset)
    cos, sin = theta.cos().to(x.dtype), theta.sin().to(x.dtype)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: repeat each KV head for the ``groups`` query heads it serves.

    x: ``[S, B, H_kv, D]``; returns ``[S, B, H_kv * groups, D]`` where query head ``h`` reads
    KV head ``h // groups``.
    """
    return x.repeat_interleave(groups, dim=2)


def causal_mask(seq: int, device=None) -> torch.Tensor:
    """``[S, S]`` bool, ``True`` where query ``s`` must not see key ``t`` (``t > s``)."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)


def attention_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention weights.

    q, k: ``[S, B, H, D]`` (same head count); returns ``[B, H, S, S]``, rows sum to 1,
    zero above the diagonal.
    """
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(q.shape[-1])
    mask = causal_mask(q.shape[0], device=q.device)
    scores = scores.masked_fill(mask.view(1, 1, *mask.shape), float("-inf"))
    return scores.softmax(-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              drop: torch.Tensor | None = None) -> torch.Tensor:
    """Causal scaled dot-product attention.

    q, k, v: ``[S, B, H, D]`` (K/V already repeated to the query head count); ``drop``: an
    attention-dropout mask ``[B, H, S, S]`` (kept elements ``1/(1-p)``, dropped 0) multiplied
    into the probabilities, or ``None``. Returns the context ``[S, B, H, D]``.
    """
    probs = attention_probs(q, k)
    if drop is not None:
        probs = probs * drop
    return torch.einsum("bhst,tbhd->sbhd", probs, v)
