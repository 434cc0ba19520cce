"""Tensor-parallel attention over simulated ranks: one list entry per rank, one autograd graph.

Each rank holds whole query/KV head groups: column-parallel Q/K/V rows, row-parallel ``wo``
columns. Megatron-LM's f (``copy_to_tensor_model_parallel_region``) and g
(``reduce_from_tensor_model_parallel_region``, ``tensor_parallel/mappings.py``) join them. In
one graph autograd does their backward: a tensor used by every rank receives the sum of their
gradients (f's all-reduce of dn), a sum hands its gradient to every term (g's identity). This
is the original fixture's model, rank 0's view; ``tpattn.parallel.engine`` runs the block per
rank with the collectives as Functions (``tpattn.parallel.collectives``).
"""
from __future__ import annotations

import torch

from tpattn.config import Config
from tpattn.block.dense import attend_and_project
from tpattn.block.layers import rms_norm
from tpattn.block.params import shard_params


def copy_to_ranks(n: torch.Tensor, world_size: int, reduce_grad: bool = True) -> list[torch.Tensor]:
    """Megatron's **f** — forward: identity, every rank gets ``n``; backward: all-reduce,
    ``n``'s gradient is the sum of every rank's contribution. (In Megatron-Core either
    ``copy_to_tensor_model_parallel_region`` in ``tensor_parallel/mappings.py`` or, with
    ``allreduce_dgrad``, the backward of ``LinearWithGradAccumulationAndAsyncCommunication``
    in ``tensor_parallel/layers.py``.)

    In one process, handing each rank the same tensor is the whole implementation: autograd
    accumulates the gradients of all its uses into one, which is the sum an all-reduce makes.

    ``reduce_grad=False`` is the ``missing_input_grad_reduce`` bug, seen from rank 0: ranks
    ``1..W-1`` get ``n.detach()`` — the same values (the forward is untouched), but their
    gradient never reaches ``n``, so ``dn`` is rank 0's contribution only, and so is what
    RMSNorm's backward passes on to ``norm`` and to ``x`` (whose residual term ``dy`` is
    unaffected).

    n: ``[S, B, hidden]``; returns ``world_size`` tensors ``[S, B, hidden]``.
    """
    return [n if reduce_grad or rank == 0 else n.detach() for rank in range(world_size)]


def reduce_output_partials(partials: list[torch.Tensor], reduce: bool = True) -> torch.Tensor:
    """Megatron's **g** — forward: all-reduce, the output is the sum of the ranks' partials
    (rank order); backward: identity, every rank's partial receives the full output gradient.

    ``reduce=False`` is the ``missing_output_reduce`` bug, seen from rank 0: the output is
    rank 0's partial only (and only rank 0's shard receives a gradient).

    partials: ``world_size`` tensors ``[S, B, hidden]``; returns ``[S, B, hidden]``.
    """
    return sum(partials) if reduce else partials[0]


def tp_forward(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config,
               reduce_output: bool = True, reduce_input_grad: bool = True,
               shard_fn=shard_params) -> torch.Tensor:
    """The block of ``dense_forward``, computed by ``cfg.world_size`` simulated TP ranks.

    x: ``[S, B, hidden]``; ``p``: dense parameters (sharded here with ``shard_fn``, so
    gradients land in ``p``). Returns ``[S, B, hidden]``.

    ``reduce_output=False`` drops g (the forward sum of output partials);
    ``reduce_input_grad=False`` drops f's backward sum of ``dn``, the ranks' contributions to
    the gradient of the normalized input ``n``.
    ``shard_fn(p, cfg)`` returns one shard dict per rank (default ``shard_params``); another
    sharding, e.g. a deliberately wrong one, can be passed in its place.
    """
    n = rms_norm(x, p["norm"], cfg.eps)  # replicated: every rank computes the same n
    inputs = copy_to_ranks(n, cfg.world_size, reduce_grad=reduce_input_grad)
    partials = [attend_and_project(n_rank, shard, cfg)
                for n_rank, shard in zip(inputs, shard_fn(p, cfg))]
    return x + reduce_output_partials(partials, reduce=reduce_output)
