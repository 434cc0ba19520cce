"""``observe`` and ``diagnose`` on real torch.distributed ranks: every process trains its own
shard on its own batch (``engine.train_step`` on ``RealRanks``) and gathers the other ranks'
numbers after each step; every rank holds the same observables, rank 0 diagnoses."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpattn.check.core import LR
from tpattn.config import Config
from tpattn.parallel.engine import stack_ranks, train_step, unstack_ranks
from tpattn.parallel.rng import process_streams, state_checksum
from tpattn.real.backend import RealRanks, build_groups, gather_step
from tpattn.real.ranks import run_rank

from .diagnose import diagnose
from .observe import observe, train_loop

__all__ = ["RealTrain", "diagnose_rank"]


class RealTrain:
    """``observe_injection``'s ``train`` on real rank ``rank`` of ``groups``
    (``build_groups``): it trains ``shards[rank]`` on ``batches[rank]``, gathers the rest."""

    def __init__(self, groups: dict, rank: int, device="cpu"):
        self.groups, self.rank, self.device = groups, rank, torch.device(device)

    def __call__(self, shards, batches, cfg: Config, inj, steps: int,
                 seed: int | None = None) -> dict:
        r = self.rank
        rng = process_streams(cfg, seed, r % cfg.world_size, inj) if cfg.dropout > 0 else None
        checksums = _gathered(state_checksum(torch.default_generator)) if rng is not None else None
        x, target = (t.to(self.device).unsqueeze(0) for t in batches[r])
        targets = torch.stack([t for _, t in batches])
        def step(p):
            comm = RealRanks(cfg, self.groups, r, job="observe")
            result = train_step(p, x, target, cfg, inj, comm, LR, rng)
            every = gather_step(result, comm, targets)
            out = {"losses": list(every["losses"]), "grads": unstack_ranks(every["grads"]),
                   "ledger": result["ledger"], "grad_norm": result["grad_norm"],
                   "outputs": every["outputs"]}
            return out, result["weights"], unstack_ranks(every["weights"])
        state = {k: t.to(self.device) for k, t in stack_ranks([shards[r]]).items()}
        return train_loop(state, step, steps, cfg, checksums)


def _gathered(value: float) -> list[float]:
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, value)
    return parts


def diagnose_rank(rank: int, plan, device="cpu", on_progress=None) -> dict:
    """``run_rank``'s jobs, then each (mode, seed) of ``plan.jobs`` observed on these real
    ranks; rank 0's dict also holds the ``observations`` and their ``diagnoses``."""
    groups = build_groups(plan.cfg, torch.device(device).type, plan.timeout)
    out = run_rank(rank, plan, device, on_progress, groups)
    observations = [observe(mode, seed, plan.cfg, train=RealTrain(groups, rank, device))
                    for mode, seed in plan.jobs]
    if rank == 0:
        out["observations"] = observations
        out["diagnoses"] = [diagnose(obs) for obs in observations]
    return out
