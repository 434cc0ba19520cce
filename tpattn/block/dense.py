"""The dense (single-device) attention block: the reference every TP variant is compared to."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpattn.config import Config
from .layers import apply_rope, attention, repeat_kv, rms_norm


def project_qkv(n: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q/K/V split into heads, RoPE on Q and K: n ``[S, B, hidden]``, wq ``[Hq*D, hidden]``,
    wk, wv ``[Hkv*D, hidden]`` -> q ``[S, B, Hq, D]``, k, v ``[S, B, Hkv, D]`` (head counts
    from the weights: dense or one rank's shard)."""
    s, b = n.shape[0], n.shape[1]
    q = F.linear(n, wq).view(s, b, -1, head_dim)
    k = F.linear(n, wk).view(s, b, -1, head_dim)
    v = F.linear(n, wv).view(s, b, -1, head_dim)
    return apply_rope(q), apply_rope(k), v


def qk_normed_qkv(n: torch.Tensor, p: dict[str, torch.Tensor],
                  cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``project_qkv`` with each query and key head RMS-normalized over ``D`` (``p["q_norm"]``,
    ``p["k_norm"]`` ``[D]``) before RoPE, Qwen3's order."""
    s, b, d = n.shape[0], n.shape[1], cfg.head_dim
    q = rms_norm(F.linear(n, p["wq"]).view(s, b, -1, d), p["q_norm"], cfg.eps)
    k = rms_norm(F.linear(n, p["wk"]).view(s, b, -1, d), p["k_norm"], cfg.eps)
    return apply_rope(q), apply_rope(k), F.linear(n, p["wv"]).view(s, b, -1, d)


def attend_and_project(n: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config,
                       drop: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the heads in ``p`` (all, or one rank's), then ``wo``: n ``[S, B, hidden]``
    -> ``[S, B, hidden]``; ``drop``: an attention-dropout mask ``[B, H, S, S]``."""
    if cfg.qk_norm:
        q, k, v = qk_normed_qkv(n, p, cfg)
    else:
        q, k, v = project_qkv(n, p["wq"], p["wk"], p["wv"], cfg.head_dim)
    groups = q.shape[2] // k.shape[2]  # cfg.group_size, unless a KV head is shared by ranks
    ctx = attention(q, repeat_kv(k, groups), repeat_kv(v, groups), drop)
    return F.linear(ctx.reshape(n.shape[0], n.shape[1], -1), p["wo"])


def dense_forward(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config,
                  masks: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The pre-norm block ``x + Wo · Attention(RoPE(Wq·n), RoPE(Wk·n), Wv·n)``, ``n =
    RMSNorm(x)``: x ``[S, B, hidden]`` -> ``[S, B, hidden]``. ``masks`` (dropout):
    ``{"attention": [B, Hq, S, S], "residual": [S, B, hidden]}`` (``rng.replica_masks``)."""
    n = rms_norm(x, p["norm"], cfg.eps)
    if masks is None:
        return x + attend_and_project(n, p, cfg)
    return x + attend_and_project(n, p, cfg, masks["attention"]) * masks["residual"]
