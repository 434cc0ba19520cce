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


def qk_normed_qkv(n: torch.Tensor, p: dict[str, torch.Tensor],
                  cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``project_qkv`` with qk-norm (``cfg.qk_norm``): RMSNorm over ``head_dim`` on every
    query and key head (weights ``p["q_norm"]``, ``p["k_norm"]`` ``[head_dim]``) before RoPE,
    Qwen3's order. n: ``[S, B, hidden]``; returns q ``[S, B, Hq, D]``, k, v ``[S, B, Hkv, D]``."""
    s, b, d = n.shape[0], n.shape[1], cfg.head_dim
    q = rms_norm(F.linear(n, p["wq"]).view(s, b, -1, d), p["q_norm"], cfg.eps)
    k = rms_norm(F.linear(n, p["wk"]).view(s, b, -1, d), p["k_norm"], cfg.eps)
    return apply_rope(q), apply_rope(k), F.linear(n, p["wv"]).view(s, b, -1, d)


def attend_and_project(n: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config,
                       drop: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the heads in ``p`` followed by the output projection ``wo``.

    n: ``[S, B, hidden]`` (normalized input); ``p`` holds wq, wk, wv, wo for some number of
    complete query/KV groups (all of them, or one rank's; or, when ``kv_heads < world_size``,
    one rank's query heads and the one KV head they read), and with ``cfg.qk_norm`` the
    q/k-norm weights. ``drop``: an attention-dropout mask ``[B, H, S, S]`` or ``None``.
    Returns ``[S, B, hidden]``: the full output for dense weights, one rank's *partial* sum
    for a shard.
    """
    if cfg.qk_norm:
        q, k, v = qk_normed_qkv(n, p, cfg)
    else:
        q, k, v = project_qkv(n, p["wq"], p["wk"], p["wv"], cfg.head_dim)
    groups = q.shape[2] // k.shape[2]  # cfg.group_size, unless a KV head is shared by ranks
    ctx = attention(q, repeat_kv(k, groups), repeat_kv(v, groups), drop)
    return F.linear(ctx.reshape(n.shape[0], n.shape[1], -1), p["wo"])


def dense_forward(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config,
                  masks: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """One pre-norm attention block: ``x + Wo · Attention(RoPE(Wq·n), RoPE(Wk·n), Wv·n)``,
    ``n = RMSNorm(x)`` (with ``cfg.qk_norm``, each query and key head RMS-normalized before
    RoPE).

    ``masks`` (dropout, ``cfg.dropout > 0``): ``{"attention": [B, Hq, S, S], "residual":
    [S, B, hidden]}``, multiplied into the attention probabilities and into the attention
    output before the residual add (``tpattn.parallel.rng.replica_masks`` draws the ones the
    ranks draw). x: ``[S, B, hidden]``; returns ``[S, B, hidden]``.
    """
    n = rms_norm(x, p["norm"], cfg.eps)
    if masks is None:
        return x + attend_and_project(n, p, cfg)
    return x + attend_and_project(n, p, cfg, masks["attention"]) * masks["residual"]
