"""``engine.train_step`` on ``SimulatedRanks`` (every rank in one process); rank 0's report."""
from __future__ import annotations

import torch

from tpattn.config import Config
from tpattn.block.params import unshard_params
from .collectives import SimulatedRanks
from .engine import rank_block, stack_ranks, train_step

__all__ = ["simulated_step", "simulated_forward", "forward_rank_list", "rank_steps",
           "gather_steps", "rank0_view", "mesh_view", "replica_views"]


def _stacked(per_rank):
    return per_rank if isinstance(per_rank, dict) else stack_ranks(per_rank)


def simulated_step(shards, batches, cfg: Config, inj, lr: float, rng=None) -> dict:
    """``engine.train_step`` on every rank; batches: ``(x, target)`` ``[S_r, B, hidden]`` each."""
    x, target = (torch.stack(t) for t in zip(*batches))
    return train_step(_stacked(shards), x, target, cfg, inj, SimulatedRanks(cfg, []), lr, rng)


def simulated_forward(shards, xs, cfg: Config, inj, rng=None) -> torch.Tensor:
    """Every rank's output ``[R, S_r, B, hidden]`` of ``xs`` (one per rank), no step."""
    return rank_block(torch.stack(list(xs)), _stacked(shards), cfg, inj, SimulatedRanks(cfg),
                      rng)


def rank_steps(step: dict) -> list[dict]:
    """A ``simulated_step`` as one ``one_step``-style dict per rank."""
    return [{"output": step["outputs"][r], "loss": step["losses"][r],
             "input_grad": step["input_grads"][r],
             "grads": {k: t[r] for k, t in step["grads"].items()},
             "weights": {k: t[r] for k, t in step["weights"].items()}}
            for r in range(step["outputs"].shape[0])]


def gather_steps(steps: list[dict], cfg: Config, unshard=None) -> dict:
    """Rank 0's ``one_step``-style report of ``rank_steps``: its output, loss, dX (SP: every
    rank's tokens), full-size grads and weights (``unshard``, default ``unshard_params``)."""
    unshard = unshard or (lambda per_rank: unshard_params(per_rank, cfg))
    output, input_grad = steps[0]["output"], steps[0]["input_grad"]
    if cfg.sequence_parallel:
        output = torch.cat([s["output"] for s in steps])
        input_grad = torch.cat([s["input_grad"] for s in steps])
    return {"output": output, "loss": steps[0]["loss"], "input_grad": input_grad,
            "grads": unshard([s["grads"] for s in steps]),
            "weights": unshard([s["weights"] for s in steps])}


def rank0_view(step: dict, cfg: Config, unshard=None) -> dict:
    """``gather_steps`` of a ``simulated_step``."""
    return gather_steps(rank_steps(step), cfg, unshard)


def replica_views(step: dict, cfg: Config, unshard=None) -> list[dict]:
    """``gather_steps`` of each DP replica's TP group of a mesh's ``simulated_step``."""
    steps, w = rank_steps(step), cfg.world_size
    return [gather_steps(steps[d * w:(d + 1) * w], cfg, unshard)
            for d in range(cfg.data_parallel)]


def mesh_view(step: dict, cfg: Config, unshard=None) -> dict:
    """Global rank 0's report of a mesh's ``simulated_step``: every replica's output and dX
    along the batch (``[S, B * DP, hidden]``), rank 0's loss, replica 0's grads and weights."""
    views = replica_views(step, cfg, unshard)
    return {"output": torch.cat([v["output"] for v in views], dim=1), "loss": views[0]["loss"],
            "input_grad": torch.cat([v["input_grad"] for v in views], dim=1),
            "grads": views[0]["grads"], "weights": views[0]["weights"]}


def forward_rank_list(xs: list[torch.Tensor], shards: list[dict[str, torch.Tensor]],
                      cfg: Config, inj) -> list[torch.Tensor]:
    """``engine.rank_block`` on one ``[S_r, B, hidden]`` per rank in and out (differentiable)."""
    p = {k: torch.stack([s[k] for s in shards]) for k in shards[0]}
    return list(simulated_forward(p, xs, cfg, inj).unbind(0))
