"""Tensor-parallel attention over *simulated* ranks (one process, one list entry per rank).

Each rank holds complete query/KV head groups: column-parallel Q/K/V (its rows of wq, wk, wv),
row-parallel output projection (its columns of wo). Two collectives make the sharded block
equal the dense one — Megatron-LM's *f* and *g* (``tensor_parallel/mappings.py``:
``copy_to_tensor_model_parallel_region`` and ``reduce_from_tensor_model_parallel_region``;
current Megatron-Core also issues f's backward all-reduce inside the column-parallel layer,
``LinearWithGradAccumulationAndAsyncCommunication`` in ``tensor_parallel/layers.py``, when
``allreduce_dgrad`` is set)::

          f                                                  g
    n ── copy ──┬─ rank 0: Q/K/V shard ─ attention ─ wo ─┬─ sum ─ (+ x)
                └─ rank 1: Q/K/V shard ─ attention ─ wo ─┘
    backward:  sum of the ranks' dn             copy to every rank

f's backward sums ``dn = ∂L/∂n``, the gradient at the input of the sharded region (after
RMSNorm), over the ranks. The input gradient ``dX = ∂L/∂x`` is the residual's ``dy`` plus
RMSNorm's backward of that sum; it is never all-reduced (summing it would count ``dy`` once
per rank).

In one process the "collectives" are plain tensor code, and autograd does the backward half:
a tensor used by several ranks receives the *sum* of their gradients (f's all-reduce), and a sum
hands its gradient unchanged to every term (g's identity). ``tpattn.distributed`` writes the
same two operations as ``torch.autograd.Function`` subclasses over real processes.
"""
from __future__ import annotations

import torch

from .config import Config
from .dense import attend_and_project
from .layers import rms_norm
from .params import shard_params


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


# --- simulated ranks that behave like real ones ------------------------------------------------
#
# ``tp_forward`` above is the seed fixture's model: one output, rank 0's view. Real ranks differ
# when a reduction is missing: each rank then computes its *own* output and loss and trains on
# them. The functions below model that in one process: rank r holds its own leaf tensors (its
# copy of x, of ``norm``, its shards), and the collectives are autograd Functions over the list
# of every rank's tensor, so one backward of the summed per-rank losses gives every rank exactly
# the gradient its own backward would (the ranks' graphs meet only inside the collectives).


class AllReduceGrads(torch.autograd.Function):
    """f over simulated ranks — forward: identity on every rank's tensor; backward: every rank
    receives the sum of all ranks' gradients (rank order), as ``dist.all_reduce`` of dn gives.

    ``apply(*tensors)``: one tensor per rank, returns one per rank.
    """

    @staticmethod
    def forward(ctx, *tensors: torch.Tensor):
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        total = sum(grads[1:], grads[0])
        return tuple(total.clone() for _ in grads)


class AllReduce(torch.autograd.Function):
    """g over simulated ranks — forward: every rank receives the sum of all ranks' tensors
    (rank order), as ``dist.all_reduce`` of the output partials gives; backward: identity, each
    rank's partial receives its own output's gradient.

    ``apply(*tensors)``: one tensor per rank, returns one per rank.
    """

    @staticmethod
    def forward(ctx, *tensors: torch.Tensor):
        total = sum(tensors[1:], tensors[0])
        return tuple(total.clone() for _ in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return grads


def tp_forward_ranks(xs: list[torch.Tensor], shards: list[dict[str, torch.Tensor]], cfg: Config,
                     reduce_output: bool = True, reduce_input_grad: bool = True,
                     f=AllReduceGrads, g=AllReduce) -> list[torch.Tensor]:
    """Every simulated rank's own output of the block, as real ranks compute it.

    xs: one ``[S, B, hidden]`` per rank (each rank's own copy of the same input); ``shards``:
    each rank's own parameters (``norm`` replicated, head-group shards of wq/wk/wv/wo), leaf
    tensors of their own. Returns one ``[S, B, hidden]`` per rank.

    ``reduce_output=False`` drops g: rank r's output is ``x + P_r``, its own partial.
    ``reduce_input_grad=False`` drops f: rank r's dn stays its own contribution.
    ``f``, ``g``: the two collectives, ``torch.autograd.Function`` subclasses whose
    ``apply(*tensors)`` maps one tensor per rank to one per rank (default ``AllReduceGrads``
    and ``AllReduce``; ``tpattn.exercises`` passes the reader's own).
    """
    ns = [rms_norm(x, shard["norm"], cfg.eps) for x, shard in zip(xs, shards)]
    if reduce_input_grad:
        ns = f.apply(*ns)
    partials = [attend_and_project(n, shard, cfg) for n, shard in zip(ns, shards)]
    outs = g.apply(*partials) if reduce_output else partials
    return [x + out for x, out in zip(xs, outs)]
