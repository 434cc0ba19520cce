"""``observe`` and ``diagnose`` on real torch.distributed ranks (``torchrun -m
tpattn.distributed --diagnose``, or ranks the CLI starts itself).

Every process is one rank; it trains its own shard on its own batch with ``engine.train_step``
on ``tpattn.real.backend.RealRanks``, so every collective of the step is a real one, in the
engine's ledger. What a rank cannot see alone (the other ranks' losses, gradients, weights)
it gets as a job's logging does: one all-gather after each step (``backend.gather_step``).
Every rank then holds the same observables, ``tpattn.diagnosis.observe``'s dict; rank 0
diagnoses. Each rank cuts every rank's shard from the checkpoint and keeps its own.
"""
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
from .observe import observe, replica_sums, train_loop

__all__ = ["RealTrain", "observe_on_rank", "diagnose_rank"]


class RealTrain:
    """``observe_injection``'s ``train`` on one real rank: ``(shards, batches, cfg, inj,
    steps, last_update, seed) -> train_loop``'s dict, every rank's numbers gathered (the same
    on every rank). shards, batches: every rank's (mesh order; ``(x, target)``
    ``[S_r, B, hidden]``); this rank trains ``shards[rank]`` on ``batches[rank]``.
    ``groups``: ``tpattn.real.backend.build_groups``'s."""

    def __init__(self, groups: dict, rank: int, device="cpu"):
        self.groups, self.rank, self.device = groups, rank, torch.device(device)

    def __call__(self, shards, batches, cfg: Config, inj, steps: int,
                 last_update: bool = True, seed: int | None = None) -> dict:
        r = self.rank
        # with dropout: torch's global RNG seeded with ``seed`` (the default stream), the
        # tracker's generator, tp_rank 0's loader drift under the injection
        rng = process_streams(cfg, seed, r % cfg.world_size, inj) if cfg.dropout > 0 else None
        checksum = state_checksum(torch.default_generator) if rng is not None else None
        x, target = (t.to(self.device).unsqueeze(0) for t in batches[r])
        targets = torch.stack([t for _, t in batches])

        def whole(p):
            comm = RealRanks(cfg, self.groups, r, job="observe")
            result = train_step(p, x, target, cfg, inj, comm, LR, rng)
            return result, gather_step(result, comm, targets)

        def step(p):
            result, every = whole(p)
            out = {"losses": list(every["losses"]), "grads": unstack_ranks(every["grads"]),
                   "ledger": result["ledger"], "grad_norm": result["grad_norm"],
                   "outputs": every["outputs"]}
            return out, result["weights"], unstack_ranks(every["weights"])

        def losses(p):  # a whole step: the logged loss may be a collective of it
            return list(whole(p)[1]["losses"])

        state = {k: t.to(self.device) for k, t in stack_ranks([shards[r]]).items()}
        out = train_loop(state, step, losses, steps, last_update,
                         lambda weights: replica_sums(weights, cfg))
        if checksum is not None:
            out["rng_checksums"] = _gathered(checksum)
        return out


def _gathered(value: float) -> list[float]:
    """Every rank's ``value`` (one ``all_gather_object``), in rank order."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, value)
    return parts


def observe_on_rank(mode: str, seed: int, cfg: Config, groups: dict, rank: int,
                    device="cpu", **kwargs) -> dict:
    """``observe(mode, seed, cfg, **kwargs)`` with this process as real rank ``rank`` of
    ``groups`` (``build_groups``; every rank of the group must call it with the same
    arguments); every rank returns the same dict."""
    return observe(mode, seed, cfg, train=RealTrain(groups, rank, device), **kwargs)


def diagnose_rank(rank: int, plan, device="cpu", on_progress=None) -> dict:
    """``tpattn.real.ranks.run_rank``'s jobs, then for each (mode, seed) of ``plan.jobs`` the
    observables on these real ranks and, on rank 0, their diagnosis: rank 0 returns
    ``run_rank``'s dict plus ``diagnoses`` (one ``diagnose`` list per job, in order) and
    ``observations``; other ranks return ``run_rank``'s."""
    groups = build_groups(plan.cfg, torch.device(device).type, plan.timeout)
    out = run_rank(rank, plan, device, on_progress, groups)
    observations = [observe_on_rank(mode, seed, plan.cfg, groups, rank, device)
                    for mode, seed in plan.jobs]
    if rank == 0:
        out["observations"] = observations
        out["diagnoses"] = [diagnose(obs) for obs in observations]
    return out
