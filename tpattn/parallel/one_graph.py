"""The original fixture's one-graph view (``simulate="fixture"``) as a backend of the engine:
every rank in ONE autograd graph, shards views of the dense leaves, f the identity (autograd
sums dn), g a sum over the rank dim; a dropped collective is detached copies on ranks >= 1."""
from __future__ import annotations

from dataclasses import replace

import torch

from tpattn.config import Config
from tpattn.block.kv_layout import has_replicas, replica_index
from tpattn.block.params import shard_params
from .engine import rank_block
from .program import Program
from .wrong import ScaleGrad, both_kept, no_collective

__all__ = ["OneGraphRanks", "ScaleForward", "stacked_views", "one_graph_forward",
           "one_graph_program"]


class ScaleForward(torch.autograd.Function):
    """Forward times ``scale``, backward the identity (g applied to W equal tensors)."""

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
    """Every rank of ``cfg.world_size`` in one graph, rank 0's view; no ledger."""

    def __init__(self, cfg: Config):
        self.cfg, self.world_size, self.ledger = cfg, cfg.world_size, None
        #: The global rank of each entry of dim 0.
        self.ranks = list(range(cfg.world_size))

    def rank_views(self, x: torch.Tensor, shards, inj, others: list[torch.Tensor] | None = None):
        """``(xs [W, S_r, B, hidden], p [W, ...])`` from the leaf ``x`` ``[S, B, hidden]`` and
        ``shards`` (views of the dense leaves), ``inj``'s dropped collectives as detached
        copies on ranks >= 1. ``others``: ranks >= 1's inputs."""
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
        """Rank 0's report of ``y`` ``[W, S_r, B, hidden]``: ``[S, B, hidden]``."""
        return y.reshape(-1, *y.shape[2:]) if self.cfg.sequence_parallel else y[0]


def stacked_views(p: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """``shard_params``' shards of the dense ``p`` as ``[W, ...]`` views (no KV replicas)."""
    w, hidden = cfg.world_size, p["wq"].shape[1]
    return {"norm": _broadcast(p["norm"], w),
            **{k: p[k].view(w, -1, hidden) for k in ("wq", "wk", "wv")},
            "wo": p["wo"].view(hidden, w, -1).transpose(0, 1),
            **{k: _broadcast(p[k], w) for k in ("bias", "q_norm", "k_norm") if k in p}}


def one_graph_forward(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config, inj,
                      shard_fn=shard_params, others: list[torch.Tensor] | None = None
                      ) -> torch.Tensor:
    """``engine.rank_block`` on ``OneGraphRanks``: x ``[S, B, hidden]`` -> rank 0's output."""
    if cfg.model_options:
        raise ValueError(f"one_graph_forward models neither dropout nor qk_norm (got "
                         f"dropout={cfg.dropout}, qk_norm={cfg.qk_norm}): run the simulated "
                         f"ranks (tpattn.run(..., simulate='ranks'))")
    comm = OneGraphRanks(cfg)
    plain = shard_fn is shard_params and not has_replicas(cfg)
    xs, ps = comm.rank_views(x, stacked_views(p, cfg) if plain else shard_fn(p, cfg), inj, others)
    return comm.output(rank_block(xs, ps, cfg, one_graph_program(inj), comm))


def _sum_to_all(partial: torch.Tensor, comm) -> torch.Tensor:
    """g in one graph: the sum over the rank dim ``[W, ...]``, seen by every rank."""
    return _broadcast(partial.sum(0), comm.world_size)


def _gather(n: torch.Tensor, comm) -> torch.Tensor:
    """SP's all-gather in one graph: ``[W, S/W, ...]`` -> every rank's tokens ``[W, S, ...]``."""
    return _broadcast(n.reshape(-1, *n.shape[2:]), comm.world_size)


def _gather_no_reduce(n: torch.Tensor, comm) -> torch.Tensor:
    """The all-gather without its backward reduce: ranks >= 1 see a detached copy."""
    full = n.reshape(-1, *n.shape[2:])
    return torch.cat([full.unsqueeze(0), _broadcast(full.detach(), comm.world_size - 1)])


def _scatter(partial: torch.Tensor, comm) -> torch.Tensor:
    """SP's reduce-scatter in one graph: rank r's tokens of the rank sum ``[W, S/W, ...]``."""
    return partial.sum(0).view(comm.world_size, -1, *partial.shape[2:])


def _own_tokens(full: torch.Tensor, comm) -> torch.Tensor:
    """Without SP's g: rank r's tokens of rank 0's entry (what rank 0 sees of every token)."""
    return full[0].view(comm.world_size, -1, *full.shape[2:])


def _gather_kv(local: torch.Tensor, comm) -> torch.Tensor:
    """The K/V all-gather in one graph: ``[W, S, B, c]`` -> ``[W, S, B, W*c]``."""
    return _broadcast(torch.cat(local.unbind(0), dim=-1), comm.world_size)


def one_graph_program(inj) -> Program:
    """``inj.program()`` with one graph's collectives (f the identity, g the rank sum)."""
    prog = inj.program()
    f = {"sum": no_collective, "none": no_collective,
         "mean": lambda n, comm: ScaleGrad.apply(n, 1.0 / comm.world_size),
         "twice": lambda n, comm: ScaleGrad.apply(n, float(comm.world_size))}[inj.f]
    g = {1: _sum_to_all, 0: no_collective,
         2: lambda t, comm: ScaleForward.apply(_sum_to_all(t, comm), float(comm.world_size))}
    gather = _gather_no_reduce if inj.f == "none" else _gather
    if inj.f == "mean":
        gather = lambda n, comm: ScaleGrad.apply(_gather(n, comm), 1.0 / comm.world_size)
    return replace(prog, f=f, g=g[inj.g], sp_gather=gather,
                   sp_scatter=_scatter if inj.g else _own_tokens, kv_gather=_gather_kv,
                   replica_reduce=both_kept)
