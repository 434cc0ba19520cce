"""The one-graph fixture views (rank 0's view, ``simulate="fixture"``) as the package wrote
them, one per variant, before the engine's ``tpattn.parallel.one_graph.OneGraphRanks``
replaced them (h-engine): kept here, nearly verbatim, as the reference
``tests/parallel/test_one_graph.py`` checks the engine's one-graph backend against. Not used
by the package.

- ``tp_forward_kv``: fewer KV heads than ranks (``tpattn.parallel.kv_heads``);
- ``sp_forward``: sequence parallelism (``tpattn.parallel.sequence_parallel``);
- ``forward_fixture``: the zoo's block with an ``Injection`` (``tpattn.bugs.zoo``);
- ``rank_batched_tp_forward``: plain TP with the ranks as a batch dimension
  (``tpattn.parallel.rank_batched``).
"""
from __future__ import annotations

import torch

from tpattn.block.dense import attend_and_project
from tpattn.block.kv_layout import GATHER_ACTIVATIONS, replica_index
from tpattn.block.layers import apply_rope, attention, repeat_kv, rms_norm
from tpattn.block.params import shard_params
from tpattn.bugs.zoo import shard
from tpattn.config import Config
from tpattn.parallel.wrong import ScaleGrad
from tpattn.parallel.tp import copy_to_ranks, reduce_output_partials

from .reference_ranks import attend_gathered, local_kv, rank_attend_and_project


def tp_forward_kv(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config,
                  reduce_output: bool = True, reduce_input_grad: bool = True,
                  reduce_kv_grad: bool = True) -> torch.Tensor:
    """``tp_forward`` for ``kv_heads < world_size``, in either ``cfg.kv_strategy``; without
    the replica-group reduce the non-first replicas use detached KV rows. x ``[S, B, hidden]``
    -> ``[S, B, hidden]``."""
    n = rms_norm(x, p["norm"], cfg.eps)
    inputs = copy_to_ranks(n, cfg.world_size, reduce_grad=reduce_input_grad)
    shards = shard_params(p, cfg)
    if cfg.kv_strategy == GATHER_ACTIVATIONS:
        kv_all = torch.cat([local_kv(n_r, s) for n_r, s in zip(inputs, shards)], dim=-1)
        partials = [attend_gathered(n_r, s, kv_all, cfg, r)
                    for r, (n_r, s) in enumerate(zip(inputs, shards))]
    else:
        if not reduce_kv_grad:
            shards = [s if replica_index(cfg, r) == 0 else
                      {**s, "wk": s["wk"].detach(), "wv": s["wv"].detach()}
                      for r, s in enumerate(shards)]
        partials = [attend_and_project(n_r, s, cfg) for n_r, s in zip(inputs, shards)]
    return x + reduce_output_partials(partials, reduce=reduce_output)


def sp_forward(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config,
               reduce_output: bool = True, reduce_input_grad: bool = True,
               norm_grad: str = "sum") -> torch.Tensor:
    """The SP block as one graph, rank 0's view of every dropped collective. x ``[S, B,
    hidden]`` (its ``S/W``-token chunks the ranks' shards) -> the ranks' outputs put
    together ``[S, B, hidden]``."""
    w = cfg.world_size
    xs = x.chunk(w, dim=0)
    if norm_grad == "mean":
        norms = [ScaleGrad.apply(p["norm"], 1.0 / w) for _ in range(w)]
    else:
        norms = [p["norm"] if norm_grad == "sum" or r == 0 else p["norm"].detach()
                 for r in range(w)]
    n = torch.cat([rms_norm(x_r, norm_r, cfg.eps) for x_r, norm_r in zip(xs, norms)])
    inputs = copy_to_ranks(n, w, reduce_grad=reduce_input_grad)
    partials = [attend_and_project(n_r, s, cfg) for n_r, s in zip(inputs, shard_params(p, cfg))]
    summed = reduce_output_partials(partials, reduce=reduce_output)
    return torch.cat([x_r + out_r for x_r, out_r in zip(xs, summed.chunk(w, dim=0))])


class ScaleForward(torch.autograd.Function):
    """Forward times ``scale``, backward identity."""

    @staticmethod
    def forward(ctx, t, scale):
        return t * scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def forward_fixture(xs: list[torch.Tensor], p: dict[str, torch.Tensor], cfg: Config,
                    inj) -> torch.Tensor:
    """The zoo's block, rank 0's output: xs one ``[S, B, hidden]`` per rank, ``p`` dense
    (with ``bias`` if the setup has one). Returns ``[S, B, hidden]``."""
    w = cfg.world_size
    outs = []
    for rank, (x, s) in enumerate(zip(xs, shard(p, cfg, inj))):
        n = rms_norm(x, s["norm"], cfg.eps)
        if inj.f == "none" and rank > 0:
            n = n.detach()
        elif inj.f == "mean":
            n = ScaleGrad.apply(n, 1.0 / w)
        elif inj.f == "twice":
            n = ScaleGrad.apply(n, float(w))
        partial = rank_attend_and_project(n, s, cfg, inj)
        if inj.bias == "every_rank":
            partial = partial + s["bias"]
        outs.append(partial)
    out = outs[0] if inj.g == 0 else sum(outs[1:], outs[0])
    if inj.g == 2:
        out = ScaleForward.apply(out, float(w))
    if inj.bias == "after_g":
        out = out + p["bias"]
    return xs[0] + out


class CopyToRanks(torch.autograd.Function):
    """f over a rank dimension: ``n`` ``[T, hidden]`` -> ``[W, T, hidden]`` (expanded);
    backward the sum over ranks, or rank 0's gradient only (``reduce_grad=False``)."""

    @staticmethod
    def forward(ctx, n, world_size, reduce_grad):
        ctx.reduce_grad = reduce_grad
        return n.unsqueeze(0).expand(world_size, *n.shape)

    @staticmethod
    def backward(ctx, grad):
        return (grad.sum(0) if ctx.reduce_grad else grad[0]), None, None


def rank_batched_tp_forward(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config,
                            reduce_output: bool = True,
                            reduce_input_grad: bool = True) -> torch.Tensor:
    """``tp_forward``'s block, ranks batched: x ``[S, B, hidden]`` -> ``[S, B, hidden]``."""
    s, b, hidden = x.shape
    w, d = cfg.world_size, cfg.head_dim
    q_cols = cfg.local_query_heads * d
    n = rms_norm(x, p["norm"], cfg.eps).reshape(s * b, hidden)
    n_ranks = CopyToRanks.apply(n, w, reduce_input_grad)

    def per_rank(weight):
        return torch.bmm(n_ranks, weight.view(w, -1, hidden).transpose(1, 2))

    def heads(t):
        return t.view(w, s, b, -1, d).permute(1, 2, 0, 3, 4).reshape(s, b, -1, d)

    q = apply_rope(heads(per_rank(p["wq"])))
    k = apply_rope(heads(per_rank(p["wk"])))
    v = heads(per_rank(p["wv"]))
    ctx = attention(q, repeat_kv(k, cfg.group_size), repeat_kv(v, cfg.group_size))
    ctx_ranks = ctx.reshape(s * b, w, q_cols).transpose(0, 1)
    wo_ranks = p["wo"].view(hidden, w, q_cols).permute(1, 2, 0)
    partials = torch.bmm(ctx_ranks, wo_ranks)
    out = partials.sum(0) if reduce_output else partials[0]
    return x + out.view(s, b, hidden)
