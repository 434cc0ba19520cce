"""The seed's one-graph semantics (``simulate="fixture"``) as a backend of the engine.

``OneGraphRanks`` holds every rank of ``cfg.world_size`` in ONE autograd graph, in rank 0's
view: the ranks' shards are views of the dense leaf parameters, ``x`` is one leaf seen by every
rank, and one loss is taken on what rank 0 reports (``output``). Its collectives are plain,
differentiable tensor ops whose backward autograd writes itself::

  copy_to_ranks(n)            f: identity; autograd sums the ranks' dn where
                              they meet (the shared x and norm): the all-reduce
  reduce_output(partial)      g: the sum over the rank dim, broadcast; its
                              backward hands every partial rank 0's dy
  gather_sequence(n, reduce)  SP's f: concatenation along the sequence,
                              broadcast (backward: the sum, each rank's tokens)
  reduce_scatter_sequence(p)  SP's g: the sum over ranks, each rank's tokens
  gather_kv(local)            concatenation on the last dim, broadcast
  reduce_replica_grads(k, v)  identity: replicas are views of the same dense
                              rows, autograd already sums their gradients

A DROPPED collective is modelled as rank 0 sees it (``rank_views``): without f, ranks >= 1
work on detached copies of ``x`` and ``norm`` (same values, but their dn never reaches the
shared tensors); without g, each rank's output is its own partial, and only rank 0's is in
the loss (only rank 0's shard learns); without the replica-group reduce, ranks that hold a
non-first copy of a KV head use detached rows; under sequence parallelism, without the
reduce-scatter every token's output is rank 0's partial (``own_tokens``), and the norm
weight's gradient reduce is dropped (ranks >= 1 detached) or averaged (``ScaleGrad``).
A collective applied twice: a second f multiplies the (already summed) dn by W, a second g
multiplies the output by W with an identity backward (an all-reduce of W equal tensors).

``one_graph_forward`` is the block in this view; ``tpattn.parallel.tp.tp_forward`` is the
book's short version of it for plain TP (and the seed's digits).
"""
from __future__ import annotations

import torch

from tpattn.config import Config
from tpattn.block.kv_layout import has_replicas, replica_index
from tpattn.block.params import shard_params
from .collectives import F_LABEL, G_LABEL
from .engine import ScaleGrad, rank_block

__all__ = ["OneGraphRanks", "ScaleForward", "stacked_views", "one_graph_forward"]


class ScaleForward(torch.autograd.Function):
    """Forward multiplies by ``scale``; backward is the identity (``apply(t, scale)``: an
    all-reduce of W equal tensors, as g's forward, whose backward is the identity)."""

    @staticmethod
    def forward(ctx, t, scale):
        return t * scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _broadcast(t: torch.Tensor, r: int) -> torch.Tensor:
    """``t`` ``[...]`` seen by ``r`` ranks: ``[r, ...]`` (an expanded view)."""
    return t.unsqueeze(0).expand(r, *t.shape)


class OneGraphRanks:
    """Every rank of ``cfg.world_size`` in one graph, rank 0's view (module docstring).

    The same methods as ``collectives.SimulatedRanks``; no ledger (``ledger`` is ``None``):
    this view has no messages to count.
    """

    def __init__(self, cfg: Config):
        self.cfg, self.world_size, self.ledger = cfg, cfg.world_size, None
        #: The global rank of each entry of dim 0.
        self.ranks = list(range(cfg.world_size))

    def rank_views(self, x: torch.Tensor, shards, inj, others: list[torch.Tensor] | None = None):
        """The engine's inputs in this view: ``(xs, p)``.

        x: the leaf input ``[S, B, hidden]``; shards: every rank's parameters, views of the
        dense leaves (``params.shard_params`` or another cut), as a list of per-rank dicts or
        one dict of ``[W, ...]`` tensors (``stacked_views``); ``others``: ranks >= 1's own
        inputs ``[S, B, hidden]`` (constants; default: ``x``). Returns xs ``[W, S_r, B,
        hidden]`` (under sequence parallelism rank r's tokens of ``x``) and the stacked
        parameters ``[W, ...]``, with the dropped collectives of ``inj`` modelled as rank 0
        sees them (detached copies on ranks >= 1).
        """
        cfg, w = self.cfg, self.world_size
        p = dict(shards) if isinstance(shards, dict) else \
            {k: torch.stack([s[k] for s in shards]) for k in shards[0]}
        if cfg.sequence_parallel:
            xs = x.view(w, cfg.seq // w, *x.shape[1:])
            if inj.norm_grad == "none":  # only rank 0's tokens' share reaches the weight
                p["norm"] = torch.cat([p["norm"][:1], p["norm"][1:].detach()])
            elif inj.norm_grad == "mean":
                p["norm"] = ScaleGrad.apply(p["norm"], 1.0 / w)
            return xs, p
        xs = torch.stack([x] + list(others)) if others else _broadcast(x, w)
        if inj.f == "none":  # ranks >= 1: the same n, but their dn never reaches x or norm
            xs = torch.cat([xs[:1], xs[1:].detach()])
            p["norm"] = torch.cat([p["norm"][:1], p["norm"][1:].detach()])
        if has_replicas(cfg) and inj.kv_grad == "none":  # each group's first copy learns
            keep = torch.tensor([replica_index(cfg, r) == 0 for r in self.ranks])
            for k in ("wk", "wv"):
                p[k] = torch.where(keep.view(-1, 1, 1), p[k], p[k].detach())
        return xs, p

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """What rank 0 reports of the ranks' outputs ``[W, S_r, B, hidden]``: its own
        ``[S, B, hidden]``, or under sequence parallelism every rank's tokens put together."""
        return y.reshape(-1, *y.shape[2:]) if self.cfg.sequence_parallel else y[0]

    def copy_to_ranks(self, n: torch.Tensor, label: str = F_LABEL,
                      op: str = "sum") -> torch.Tensor:
        """f on ``n`` ``[W, S, B, hidden]``: the identity (autograd's sum at the shared
        tensors is the all-reduce); ``op="avg"`` scales every rank's dn by 1/W (their sum
        is then the average); a second f (any other ``label``) scales dn by W."""
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg' (got {op!r})")
        if label != F_LABEL:
            return ScaleGrad.apply(n, float(self.world_size))
        return ScaleGrad.apply(n, 1.0 / self.world_size) if op == "avg" else n

    def reduce_output(self, partial: torch.Tensor, label: str = G_LABEL) -> torch.Tensor:
        """g on ``partial`` ``[W, S, B, hidden]``: every rank gets the rank sum; a second g
        (any other ``label``) multiplies by W, backward identity."""
        if label != G_LABEL:
            return ScaleForward.apply(partial, float(self.world_size))
        return _broadcast(partial.sum(0), self.world_size)

    def own_tokens(self, full: torch.Tensor) -> torch.Tensor:
        """Without SP's g: rank r's ``S/W`` tokens of rank 0's ``[S, ...]`` entry (what
        rank 0 sees of every token): ``[W, S/W, ...]``."""
        return full[0].view(self.world_size, -1, *full.shape[2:])

    def gather_sequence(self, n: torch.Tensor, reduce_grad: bool = True) -> torch.Tensor:
        """SP's f on ``n`` ``[W, S/W, B, hidden]`` -> ``[W, S, B, hidden]``; without its
        backward (``reduce_grad=False``) ranks >= 1 see a detached copy."""
        full = n.reshape(-1, *n.shape[2:])
        if reduce_grad:
            return _broadcast(full, self.world_size)
        return torch.cat([full.unsqueeze(0), _broadcast(full.detach(), self.world_size - 1)])

    def reduce_scatter_sequence(self, partial: torch.Tensor) -> torch.Tensor:
        """SP's g on ``partial`` ``[W, S, B, hidden]`` -> ``[W, S/W, B, hidden]``: rank r's
        tokens of the rank sum."""
        return partial.sum(0).view(self.world_size, -1, *partial.shape[2:])

    def gather_kv(self, local: torch.Tensor) -> torch.Tensor:
        """K/V all-gather on ``local`` ``[W, S, B, c]`` -> ``[W, S, B, W*c]`` (rank order)."""
        return _broadcast(torch.cat(local.unbind(0), dim=-1), self.world_size)

    def reduce_replica_grads(self, wk: torch.Tensor, wv: torch.Tensor):
        """``(wk, wv)`` unchanged: replicas are views of one dense row block, so autograd
        already sums their gradients (the replica-group all-reduce)."""
        return wk, wv


def stacked_views(p: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """``params.shard_params``'s shards of the dense ``p`` as ``[W, ...]`` views, no copy
    (every rank holds whole KV heads: ``kv_heads >= world_size``): ``norm`` expanded, the
    rows of ``wq``/``wk``/``wv`` and the columns of ``wo`` viewed rank-major."""
    w, hidden = cfg.world_size, p["wq"].shape[1]
    return {"norm": _broadcast(p["norm"], w),
            **{k: p[k].view(w, -1, hidden) for k in ("wq", "wk", "wv")},
            "wo": p["wo"].view(hidden, w, -1).transpose(0, 1)}


def one_graph_forward(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config, inj,
                      shard_fn=shard_params, others: list[torch.Tensor] | None = None
                      ) -> torch.Tensor:
    """``engine.rank_block`` on ``OneGraphRanks``: what rank 0 reports, ``[S, B, hidden]``.

    x: ``[S, B, hidden]``; ``p``: dense parameters (the ranks' shards are ``shard_fn(p, cfg)``,
    views, so gradients land in ``p``); ``inj``: the program (``Injection``); ``others``:
    ranks >= 1's own inputs (``inputs="per_rank"``). The one graph has no random streams
    and no replicated q/k-norm gradient reduce: ``cfg.dropout > 0`` or ``cfg.qk_norm`` raise
    ``ValueError`` (``check.core.tp_step`` runs the simulated ranks for them).
    """
    if cfg.model_options:
        raise ValueError(f"one_graph_forward models neither dropout nor qk_norm (got "
                         f"dropout={cfg.dropout}, qk_norm={cfg.qk_norm}): run the simulated "
                         f"ranks (tpattn.run(..., simulate='ranks'))")
    comm = OneGraphRanks(cfg)
    plain = shard_fn is shard_params and not has_replicas(cfg)
    xs, ps = comm.rank_views(x, stacked_views(p, cfg) if plain else shard_fn(p, cfg), inj, others)
    return comm.output(rank_block(xs, ps, cfg, inj, comm))
