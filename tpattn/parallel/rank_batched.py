"""Simulated TP ranks as a *batch dimension*: the same shards and the same two reductions as
``tpattn.parallel.tp``, in a few big kernels instead of a Python loop over ranks.

``tp.tp_forward`` loops over ranks: per rank, a slice of every weight (``wo``'s slice is a
strided column block), small matmuls, and in backward a full-size zero gradient per slice.
At Llama-3-8B attention sizes that loop costs 2-3x a dense step (bench/llama_shape.py). Here every weight is *viewed*
rank-major (no copy) and each rank's matmul is one entry of a batched matmul::

    wq  [Hq*D, hidden]   -> view [W, Hq/W*D, hidden]      rank r's rows
    wk  [Hkv*D, hidden]  -> view [W, Hkv/W*D, hidden]
    wo  [hidden, Hq*D]   -> view [hidden, W, Hq/W*D] -> rank r's columns

Megatron's **f** is ``CopyToRanks`` (forward: ``n`` expanded to ``[W, T, hidden]`` without a
copy; backward: the sum over the rank dimension, i.e. the all-reduce of the ranks' input
gradients) and **g** is a sum over the rank dimension of the ``[W, T, hidden]`` partials.
Attention is per head, so all ranks' heads go through ``layers.attention`` in one call.

Bit parity: none promised. The math and the reduction structure are ``tp_forward``'s, but the
kernels (batched GEMMs, one attention call, ``sum`` over ranks) block their sums differently,
so digits differ at rounding level. ``check.run`` uses this path only under
``tolerance="auto"``, where the contract is a rounding bound (``tpattn.check.tolerance``), not bits;
``tolerance="seed"`` keeps ``tp_forward`` and the seed's digits.
"""
from __future__ import annotations

import torch

from tpattn.config import Config
from tpattn.block.layers import apply_rope, attention, repeat_kv, rms_norm


class CopyToRanks(torch.autograd.Function):
    """Megatron's **f** over a rank dimension. Forward: ``n`` ``[T, hidden]`` -> ``[W, T,
    hidden]`` (an expanded view: every rank sees the same ``n``). Backward: the ranks'
    gradients ``[W, T, hidden]`` summed over ranks (all-reduce); with ``reduce_grad=False``
    (the ``missing_input_grad_reduce`` bug) rank 0's gradient only."""

    @staticmethod
    def forward(ctx, n: torch.Tensor, world_size: int, reduce_grad: bool) -> torch.Tensor:
        ctx.reduce_grad = reduce_grad
        return n.unsqueeze(0).expand(world_size, *n.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad.sum(0) if ctx.reduce_grad else grad[0]), None, None


def rank_batched_tp_forward(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config,
                            reduce_output: bool = True,
                            reduce_input_grad: bool = True) -> torch.Tensor:
    """``tp.tp_forward``'s block (same arguments, same bugs), ranks batched.

    x: ``[S, B, hidden]``; ``p``: dense parameters (viewed per rank, so gradients land in
    ``p``). Returns ``[S, B, hidden]``.
    """
    s, b, hidden = x.shape
    w, d = cfg.world_size, cfg.head_dim
    q_cols = cfg.local_query_heads * d
    n = rms_norm(x, p["norm"], cfg.eps).reshape(s * b, hidden)
    n_ranks = CopyToRanks.apply(n, w, reduce_input_grad)              # [W, T, hidden]

    def per_rank(weight: torch.Tensor) -> torch.Tensor:               # [W, T, rows/W]
        return torch.bmm(n_ranks, weight.view(w, -1, hidden).transpose(1, 2))

    # [W, T, heads/W * D] -> [S, B, heads, D]: rank-major heads are the dense head order.
    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(w, s, b, -1, d).permute(1, 2, 0, 3, 4).reshape(s, b, -1, d)

    q = apply_rope(heads(per_rank(p["wq"])))
    k = apply_rope(heads(per_rank(p["wk"])))
    v = heads(per_rank(p["wv"]))
    ctx = attention(q, repeat_kv(k, cfg.group_size), repeat_kv(v, cfg.group_size))
    ctx_ranks = ctx.reshape(s * b, w, q_cols).transpose(0, 1)        # [W, T, Hq/W*D]
    wo_ranks = p["wo"].view(hidden, w, q_cols).permute(1, 2, 0)       # [W, Hq/W*D, hidden]
    partials = torch.bmm(ctx_ranks, wo_ranks)                         # [W, T, hidden]
    out = partials.sum(0) if reduce_output else partials[0]
    return x + out.view(s, b, hidden)

