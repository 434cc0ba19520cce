"""Cross-check of sequence parallelism with PyTorch's own API (DTensor): the block's residual
stream on ``Shard(0)``; the ``norm`` gradient a ``Partial``, all-reduced when the step reads it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from tpattn.check.core import EQUIVALENCE, LR, PARAM_SEED_OFFSET, dense_reference, five_measures, make_inputs
from tpattn.config import Config
from .dtensor_check import AttentionBlock, RMSNorm, comm_counts
from .module_check import full_value
from tpattn.block.params import PARAM_NAMES, init_params
from tpattn.block.sgd import sgd_step_in_place
from tpattn.parallel.sequence_parallel import rank_tokens

__all__ = ["RMSNorm", "SequenceParallelBlock", "parallelize_sp_block", "dtensor_sp_check",
           "norm_grad_placement"]


class SequenceParallelBlock(AttentionBlock):
    """``AttentionBlock`` for ``parallelize_sp_block``: x ``[S/W, B, hidden]`` in and out, Q/K/V
    over the whole sequence (gathered by ``ColwiseParallel``)."""


def parallelize_sp_block(block: SequenceParallelBlock, world_size: int,
                         device_type: str = "cpu") -> SequenceParallelBlock:
    """Shard ``block`` in place: Megatron's TP plan with the residual stream on ``Shard(0)``."""
    mesh = init_device_mesh(device_type, (world_size,))
    plan = {"norm": SequenceParallel(sequence_dim=0),
            "wq": ColwiseParallel(input_layouts=Shard(0)),
            "wk": ColwiseParallel(input_layouts=Shard(0)),
            "wv": ColwiseParallel(input_layouts=Shard(0)),
            "wo": RowwiseParallel(output_layouts=Shard(0))}
    return parallelize_module(block, mesh, plan)


def norm_grad_placement(block: SequenceParallelBlock) -> str:
    """How DTensor holds the ``norm`` weight's gradient after backward, e.g. ``"Replicate()"``."""
    grad = block.norm.weight.grad
    return ", ".join(str(p) for p in grad.placements) if hasattr(grad, "placements") else "plain"


def dtensor_sp_check(seed: int, cfg: Config, device: torch.device | str = "cpu") -> tuple[dict, dict]:
    """On every rank: ``run(seed, "equivalence", cfg)``'s measures with DTensor's SP block, and
    its collectives ``{"forward all_gather": n, ..., "norm_grad_placement": ...}``."""
    import torch.distributed as dist

    device = torch.device(device)
    x0, target = (t.to(device) for t in make_inputs(cfg, seed))
    base = {k: v.to(device) for k, v in init_params(cfg, seed + PARAM_SEED_OFFSET).items()}
    rank, w = dist.get_rank(), cfg.world_size
    tokens = rank_tokens(cfg, rank)

    block = parallelize_sp_block(SequenceParallelBlock(base, cfg), w, device.type)
    x = x0[tokens].clone().requires_grad_(True)
    with CommDebugMode() as forward_comms:
        y = block(x)
    with CommDebugMode() as backward_comms:
        (F.mse_loss(y, target[tokens], reduction="sum") / target.numel()).backward()
    placement = norm_grad_placement(block)
    params = block.weights()
    grads = {k: full_value(params[k].grad) for k in PARAM_NAMES}  # a Partial grad: summed on reading
    with CommDebugMode() as step_comms:  # the SGD step on the DTensors
        stepped = sgd_step_in_place(params, {k: p.grad for k, p in params.items()}, LR)
    weights = {k: full_value(stepped[k]) for k in PARAM_NAMES}
    pieces = [torch.empty_like(y) for _ in range(w)], [torch.empty_like(x) for _ in range(w)]
    dist.all_gather(pieces[0], y.detach().contiguous())
    dist.all_gather(pieces[1], x.grad.contiguous())
    output = torch.cat(pieces[0])
    tp = {"output": output, "loss": F.mse_loss(output, target), "input_grad": torch.cat(pieces[1]),
          "grads": grads, "weights": weights}
    ledger = {**comm_counts(forward_comms, "forward"), **comm_counts(backward_comms, "backward"),
              **comm_counts(step_comms, "SGD step"), "norm_grad_placement": placement}
    return five_measures(seed, EQUIVALENCE, dense_reference(x0, target, base, cfg), tp), dict(ledger)
