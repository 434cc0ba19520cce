"""The simulated backend: every rank of the group in one process, as dim 0 of every tensor.

``simulated_step`` is one training step of ``engine.rank_block`` on ``SimulatedRanks``: each
rank has its own parameters, input, output, loss and backward, as real ranks run; their graphs
meet only in the collectives. ``rank0_view`` is what rank 0 reports of it.
"""
from __future__ import annotations

import torch

from ..config import Config
from ..params import unshard_params
from .collectives import SimulatedRanks
from .engine import rank_block, stack_ranks, train_step, unstack_ranks

__all__ = ["simulated_step", "simulated_forward", "rank0_view"]


def _stacked(per_rank):
    return per_rank if isinstance(per_rank, dict) else stack_ranks(per_rank)


def simulated_step(shards, batches, cfg: Config, inj, lr: float, f=None, g=None) -> dict:
    """``engine.train_step`` on every rank of ``cfg.world_size``.

    shards: every rank's parameters (a list of per-rank dicts, or one stacked dict
    ``[W, ...]``); batches: every rank's ``(x, target)`` (``[S_r, B, hidden]`` each).
    ``f``, ``g``: optional reader's collectives (``collectives.SimulatedRanks``). Returns
    ``train_step``'s dict (stacked tensors; ``ledger`` the collectives, in order)."""
    x = torch.stack([b[0] for b in batches])
    target = torch.stack([b[1] for b in batches])
    comm = SimulatedRanks(cfg, [], f=f, g=g)
    return train_step(_stacked(shards), x, target, cfg, inj, comm, lr)


def simulated_forward(shards, xs, cfg: Config, inj) -> torch.Tensor:
    """Every rank's output ``[W, S_r, B, hidden]`` of ``xs`` (one per rank), no step."""
    return rank_block(torch.stack(list(xs)), _stacked(shards), cfg, inj, SimulatedRanks(cfg))


def rank0_view(step: dict, cfg: Config, unshard=None) -> dict:
    """What rank 0 reports of a ``simulated_step``, in ``check.one_step``'s dict: its own
    output, loss and dX (under sequence parallelism every rank's tokens put together, the
    loss the global MSE), and the full-size gradients and weights from every rank's own
    (``unshard(per_rank_dicts)``, default ``params.unshard_params``)."""
    unshard = unshard or (lambda per_rank: unshard_params(per_rank, cfg))
    if cfg.sequence_parallel:
        output = torch.cat(step["outputs"].unbind(0))
        input_grad = torch.cat(step["input_grads"].unbind(0))
    else:
        output, input_grad = step["outputs"][0], step["input_grads"][0]
    return {"output": output, "loss": step["losses"][0], "input_grad": input_grad,
            "grads": unshard(unstack_ranks(step["grads"])),
            "weights": unshard(unstack_ranks(step["weights"]))}
