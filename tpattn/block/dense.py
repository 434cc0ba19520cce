"""The dense (single-device) attention block: the reference every TP variant is compared to."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpattn.config import Config
from .layers import apply_rope, attention, repeat_kv, rms_norm


def project_qkv(n: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q/K/V projections split into heads, with RoPE applied to Q and K.

    n: ``[S, B, hidden]``; wq: ``[Hq*D, hidden]``; wk, wv: ``[Hkv*D, hidden]``.
    Returns q ``[S, B, Hq, D]``, k and v ``[S, B, Hkv, D]``. The head counts come from the
    weights, so the same function serves the dense block and one TP rank's shard.
    """
    s, b = n.shape[0], n.shape[1]
    q = F.linear(n, wq).view(s, b, -1, head_dim)
    k = F.linear(n, wk).view(s, b, -1, head_dim)
    v = F.linear(n, wv).view(s, b, -1, head_dim)
    return apply_rope(q), apply_rope(k), v


def attend_and_project(n: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    """Attention over the heads in ``p`` followed by the output projection ``wo``.

    n: ``[S, B, hidden]`` (normalized input); ``p`` holds wq, wk, wv, wo for some number of
    complete query/KV groups (all of them, or one rank's; or, when ``kv_heads < world_size``,
    one rank's query heads and the one KV head they read). Returns ``[S, B, hidden]``: the full
    output for dense weights, one rank's *partial* sum for a shard.
    """
    q, k, v = project_qkv(n, p["wq"], p["wk"], p["wv"], cfg.head_dim)
    groups = q.shape[2] // k.shape[2]  # cfg.group_size, unless a KV head is shared by ranks
    ctx = attention(q, repeat_kv(k, groups), repeat_kv(v, groups))
    return F.linear(ctx.reshape(n.shape[0], n.shape[1], -1), p["wo"])


def dense_forward(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    """One pre-norm attention block: ``x + Wo · Attention(RoPE(Wq·n), RoPE(Wk·n), Wv·n)``,
    ``n = RMSNorm(x)``.

    x: ``[S, B, hidden]``; returns ``[S, B, hidden]``.
    """
    n = rms_norm(x, p["norm"], cfg.eps)
    return x + attend_and_project(n, p, cfg)
