"""Tensor-parallel attention in one autograd graph, rank 0's view: one list entry per rank,
f and g as plain tensor ops whose backward autograd writes."""
from __future__ import annotations

import torch

from tpattn.config import Config
from tpattn.block.dense import attend_and_project
from tpattn.block.layers import rms_norm
from tpattn.block.params import shard_params


def copy_to_ranks(n: torch.Tensor, world_size: int, reduce_grad: bool = True) -> list[torch.Tensor]:
    """Megatron's **f**: every rank gets ``n`` ``[S, B, hidden]``; backward the sum of every
    rank's dn. ``reduce_grad=False``: ranks ``1..W-1`` get ``n.detach()`` (dn is rank 0's)."""
    return [n if reduce_grad or rank == 0 else n.detach() for rank in range(world_size)]


def reduce_output_partials(partials: list[torch.Tensor], reduce: bool = True) -> torch.Tensor:
    """Megatron's **g**: the sum of the ranks' partials ``[S, B, hidden]`` (rank order);
    backward the identity. ``reduce=False``: rank 0's partial."""
    return sum(partials) if reduce else partials[0]


def tp_forward(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config,
               reduce_output: bool = True, reduce_input_grad: bool = True,
               shard_fn=shard_params) -> torch.Tensor:
    """``dense_forward`` on ``cfg.world_size`` simulated ranks: x ``[S, B, hidden]``, dense ``p``
    (cut by ``shard_fn``, gradients land in ``p``) -> ``[S, B, hidden]``; ``reduce_output=False``
    drops g, ``reduce_input_grad=False`` f's backward sum."""
    n = rms_norm(x, p["norm"], cfg.eps)  # replicated: every rank computes the same n
    inputs = copy_to_ranks(n, cfg.world_size, reduce_grad=reduce_input_grad)
    partials = [attend_and_project(n_rank, shard, cfg)
                for n_rank, shard in zip(inputs, shard_fn(p, cfg))]
    return x + reduce_output_partials(partials, reduce=reduce_output)
