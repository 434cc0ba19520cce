"""Sequence parallelism with PyTorch's own API (DTensor): the block's residual stream on
``Shard(0)``; the ``norm`` gradient a ``Partial``, all-reduced when the step reads it."""
from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from .dtensor_check import AttentionBlock

__all__ = ["SequenceParallelBlock", "parallelize_sp_block"]


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
