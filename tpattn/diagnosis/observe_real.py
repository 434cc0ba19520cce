"""``observe`` and ``diagnose`` on real torch.distributed ranks (``torchrun -m
tpattn.distributed --diagnose``, or ranks the CLI starts itself).

Every process is one TP rank. It trains its own shard on its own batch with
``engine.train_step`` through ``tpattn.real.ranks.DistributedRanks`` (R = 1), so every
collective of the step is a real one, recorded by the rank's ``CollectiveLedger`` as it is
issued. What a rank cannot see alone (the other ranks' losses, gradients and replica
checksums) it gets the way a job's logging does: one all-gather after each step. Every rank
then holds the same observables, ``tpattn.diagnosis.observe``'s dict; rank 0 diagnoses.

Shortcuts of this module, not of real jobs: each rank cuts every rank's shard from the
checkpoint (the shapes are tiny) and keeps its own, and the shard checksums compare what rank
r loaded with the slice rank r should hold, as in the simulation; the tier-2 fit of the output
change against the good run's partials (``output_outside_partials``) recomputes those
partials in this process, on simulated ranks.
"""
from __future__ import annotations

import torch

from tpattn.check.core import LR
from tpattn.config import Config
from tpattn.parallel.engine import rank_block, stack_ranks, train_step, unstack_ranks
from tpattn.parallel.rng import process_streams, state_checksum
from tpattn.real.ranks import CollectiveLedger, DistributedRanks, rank_ledger, run_rank

from .diagnose import diagnose
from .observe import observe, replica_sums, train_loop

__all__ = ["DistributedTrain", "MeshTrain", "observe_on_rank", "diagnose_rank"]


class DistributedTrain:
    """``observe_injection``'s ``train`` on one real rank: ``(shards, batches, cfg, inj,
    steps, last_update) -> train_loop``'s dict, every rank's numbers gathered (the same on
    every rank). shards: every rank's dict; batches: every rank's ``(x, target)``
    ``[S_r, B, hidden]``; this rank trains ``shards[rank]`` on ``batches[rank]``."""

    def __init__(self, ledger: CollectiveLedger, rank: int, device="cpu"):
        self.ledger, self.rank, self.device = ledger, rank, torch.device(device)

    def _gather(self, tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Every rank's ``tensors`` (one all-gather), back on the CPU."""
        return [{k: t.cpu() for k, t in part.items()}
                for part in self.ledger.gather_tensors(tensors, "gather of the step's logs")]

    def _losses(self, part_losses: list[torch.Tensor], cfg: Config) -> list[torch.Tensor]:
        """Every rank's logged loss from each rank's own: under sequence parallelism the
        global MSE (the sum of the ranks' shares) on every rank."""
        if cfg.sequence_parallel:
            total = sum(part_losses[1:], part_losses[0])
            return [total] * len(part_losses)
        return part_losses

    def __call__(self, shards, batches, cfg: Config, inj, steps: int,
                 last_update: bool = True, seed: int | None = None) -> dict:
        r, dev = self.rank, self.device
        # with dropout: torch's global RNG seeded with ``seed`` (the default stream), the
        # tracker's generator, tp_rank 0's loader drift under the injection
        rng = process_streams(cfg, seed, r, inj) if cfg.dropout > 0 else None
        checksums = None
        if rng is not None:
            mine = torch.tensor([state_checksum(torch.default_generator)], dtype=torch.float64)
            checksums = [float(d["rng"][0])
                         for d in self._gather({"rng": mine})]
        streams = {} if rng is None else {"rng": rng}
        x, target = (t.to(dev).unsqueeze(0) for t in batches[r])
        numel = target.numel() * cfg.world_size if cfg.sequence_parallel else target.numel()

        def step(p):
            self.ledger.start_job("observe", [])
            comm = DistributedRanks(cfg, self.ledger, r)
            result = train_step(p, x, target, cfg, inj, comm, LR, **streams)
            entries = list(self.ledger.entries)
            mine = {"loss": result["losses"].reshape(1), "output": result["outputs"][0],
                    **{"grad_" + k: g[0] for k, g in result["grads"].items()},
                    **{"weight_" + k: w[0] for k, w in result["weights"].items()}}
            ranks = self._gather(mine)
            names = list(result["grads"])
            out = {"losses": self._losses([d["loss"][0] for d in ranks], cfg),
                   "grads": [{k: d["grad_" + k] for k in names} for d in ranks],
                   "ledger": entries, "grad_norm": result["grad_norm"],
                   "outputs": torch.stack([d["output"] for d in ranks])}
            weights = [{k: d["weight_" + k] for k in names} for d in ranks]
            return out, result["weights"], weights

        def losses(p):
            with torch.no_grad():
                comm = DistributedRanks(cfg, self.ledger, r)
                y = rank_block(x, p, cfg, inj, comm, **streams)
                own = ((y - target).pow(2).sum() / numel).reshape(1)
            return self._losses([d["loss"][0] for d in self._gather({"loss": own})], cfg)

        state = {k: t.to(dev) for k, t in stack_ranks([shards[r]]).items()}
        out = train_loop(state, step, losses, steps, last_update,
                         lambda weights: replica_sums(weights, cfg))
        if checksums is not None:
            out["rng_checksums"] = checksums
        return out


class MeshTrain:
    """``observe_injection``'s ``train`` on one real rank of a TP x DP mesh
    (``tpattn.real.mesh_ranks``): ``engine.train_step`` through ``MeshRanks`` (the mesh's
    real groups), every rank's step gathered after each step (``gather_mesh_step``, one
    ``all_gather_object``: what a job's logging collects). shards, batches: every rank's of
    the mesh, in mesh order; this rank trains ``shards[rank]`` on ``batches[rank]``."""

    def __init__(self, mesh, self_group, rank: int):
        self.mesh, self.self_group, self.rank = mesh, self_group, rank

    def __call__(self, shards, batches, cfg: Config, inj, steps: int,
                 last_update: bool = True) -> dict:
        from tpattn.real.mesh_ranks import MeshRanks, gather_mesh_step

        x, target = (t.unsqueeze(0) for t in batches[self.rank])

        def whole(p):
            comm = MeshRanks(cfg, self.mesh, self.self_group, [])
            result = train_step(p, x, target, cfg, inj, comm, LR)
            return result, gather_mesh_step(result)

        def step(p):
            result, every = whole(p)
            out = {"losses": list(every["losses"]), "grads": unstack_ranks(every["grads"]),
                   "ledger": result["ledger"], "grad_norm": result["grad_norm"],
                   "outputs": every["outputs"]}
            return out, result["weights"], unstack_ranks(every["weights"])

        def losses(p):  # the logged loss: its all-reduce is part of the step
            return list(whole(p)[1]["losses"])

        state = stack_ranks([shards[self.rank]])
        return train_loop(state, step, losses, steps, last_update,
                          lambda weights: replica_sums(weights, cfg))


def observe_on_rank(mode: str, seed: int, cfg: Config, ledger: CollectiveLedger, rank: int,
                    device="cpu", **kwargs) -> dict:
    """``observe(mode, seed, cfg, **kwargs)`` with this process as real rank ``rank`` (every
    rank of the group must call it with the same arguments); every rank returns the same
    dict. On a TP x DP mesh (``cfg.data_parallel > 1``) ``ledger`` is ``(mesh, self_group)``
    (``tpattn.real.mesh_ranks.build_mesh``) and the ranks train through ``MeshTrain``."""
    if cfg.data_parallel > 1:
        return observe(mode, seed, cfg, train=MeshTrain(*ledger, rank), **kwargs)
    return observe(mode, seed, cfg, train=DistributedTrain(ledger, rank, device), **kwargs)


def diagnose_rank(rank: int, plan, device="cpu", on_progress=None) -> dict:
    """``tpattn.real.ranks.run_rank``'s jobs, then for each (mode, seed) of ``plan.jobs`` the
    observables on these real ranks and, on rank 0, their diagnosis: rank 0 returns
    ``run_rank``'s dict plus ``diagnoses`` (one ``diagnose`` list per job, in order) and
    ``observations``; other ranks return ``run_rank``'s."""
    out = run_rank(rank, plan, device, on_progress)
    if plan.cfg.data_parallel > 1:  # a TP x DP mesh: its groups, not a TP ledger
        from tpattn.real.mesh_ranks import build_mesh

        ledger = build_mesh(plan.cfg, plan.timeout)
    else:
        ledger = rank_ledger(plan.cfg, rank, plan.timeout)
    observations = [observe_on_rank(mode, seed, plan.cfg, ledger, rank, device)
                    for mode, seed in plan.jobs]
    if rank == 0:
        out["observations"] = observations
        out["diagnoses"] = [diagnose(obs) for obs in observations]
    return out
