r"""How large the summands of each parameter gradient are (a sum is off by about ``u sqrt(n)
sum |a_i|``, not ``u |s|``): the dense backward in float64 with every factor in absolute value."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tpattn.config import Config
from tpattn.block.dense import project_qkv
from tpattn.block.layers import attention_probs, repeat_kv, rope_angles


def _rope_abs_transpose(m: torch.Tensor) -> torch.Tensor:
    """RoPE's backward with ``|cos|``, ``|sin|``: ``m`` ``[S, B, H, D]`` of magnitudes."""
    theta = rope_angles(m.shape[0], m.shape[-1], dtype=m.dtype, device=m.device)
    cos, sin = theta.cos().abs(), theta.sin().abs()
    half = m.shape[-1] // 2
    a, b = m[..., :half], m[..., half:]
    return torch.cat([a * cos + b * sin, a * sin + b * cos], dim=-1)


def backward_magnitudes(x0: torch.Tensor, base: dict[str, torch.Tensor], cfg: Config,
                        upstream: torch.Tensor) -> dict[str, torch.Tensor]:
    """``|J_p|^T upstream`` for every parameter: the dense backward from ``upstream``
    ``[S, B, hidden]`` (non-negative, in place of ``|dL/dy|``) with every factor in absolute
    value. x0: ``[S, B, hidden]``; returns float64 tensors of the parameters' shapes."""
    return _magnitudes(x0, base, cfg, lambda y: upstream.detach().to(torch.float64))


def gradient_magnitudes(x0: torch.Tensor, target: torch.Tensor,
                        base: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """``M_p >= |dL/dp|`` of every parameter gradient of the MSE loss (``backward_magnitudes``
    from ``2 |y - target| / N``), float64 tensors of the parameters' shapes."""
    t = target.detach().to(torch.float64)
    return _magnitudes(x0, base, cfg, lambda y: (y - t).abs() * (2.0 / y.numel()))


def _magnitudes(x0, base, cfg: Config, upstream_of) -> dict[str, torch.Tensor]:
    """The float64 forward once, then ``backward_magnitudes`` from ``upstream_of(y)``."""
    d, D = torch.float64, cfg.head_dim
    x = x0.detach().to(d)
    p = {k: v.detach().to(d) for k, v in base.items()}
    S, B, h = x.shape
    xh = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.eps)
    n = xh * p["norm"]
    q, k, v = project_qkv(n, p["wq"], p["wk"], p["wv"], D)
    groups = q.shape[2] // k.shape[2]
    kr, vr = repeat_kv(k, groups), repeat_kv(v, groups)
    probs = attention_probs(q, kr)  # [B, H, S, S], >= 0
    ctx = torch.einsum("bhst,tbhd->sbhd", probs, vr)
    m_y = upstream_of(x + F.linear(ctx.reshape(S, B, -1), p["wo"]))
    tokens = S * B

    def weight(m_out, inp):  # |dL/dW| summands of W in out = inp W^T: [out, in]
        return m_out.reshape(tokens, -1).T @ inp.abs().reshape(tokens, -1)

    def group_sum(m):  # repeat_kv's backward: [S, B, Hq, D] -> [S, B, Hkv, D]
        return m.view(S, B, -1, groups, D).sum(3)

    m_ctx = (m_y @ p["wo"].abs()).view(S, B, -1, D)
    m_dp = torch.einsum("sbhd,tbhd->bhst", m_ctx, vr.abs())
    m_v = group_sum(torch.einsum("bhst,sbhd->tbhd", probs, m_ctx))
    m_scores = probs * (m_dp + (probs * m_dp).sum(-1, keepdim=True)) / math.sqrt(D)
    m_q = _rope_abs_transpose(torch.einsum("bhst,tbhd->sbhd", m_scores, kr.abs()))
    m_k = _rope_abs_transpose(group_sum(torch.einsum("bhst,sbhd->tbhd", m_scores, q.abs())))
    out = {"wo": weight(m_y, ctx), "wq": weight(m_q, n), "wk": weight(m_k, n),
           "wv": weight(m_v, n)}
    m_n = sum(m.reshape(S, B, -1) @ p[w].abs() for m, w in ((m_q, "wq"), (m_k, "wk"), (m_v, "wv")))
    out["norm"] = (m_n * xh.abs()).sum((0, 1))
    return {name: out[name] for name in base}

