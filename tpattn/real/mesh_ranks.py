"""A TP x DP mesh on real ranks: one torch.distributed process per rank of the mesh.

The job's ``cfg.ranks = world_size * data_parallel`` processes build their groups with
PyTorch's ``DeviceMesh``::

    mesh = init_device_mesh("cpu", (data_parallel, world_size),
                            mesh_dim_names=("dp", "tp"))
    mesh.get_group("tp"), mesh.get_group("dp")    # global rank = dp * W + tp

``MeshRanks`` is ``tpattn.parallel.collectives.SimulatedRanks`` for ONE real rank (``R = 1``):
the engine's collectives and the ledger entries are the simulated ranks' own methods, and
only the group operations underneath are real collectives over the named group —
``group_sum`` an ``all_reduce``, ``group_cat`` an ``all_gather``, ``scatter_sum`` a
``reduce_scatter_single`` (sequence parallelism), the DP gradient all-reduce one flat
``all_reduce`` over the DP group (``dp_grad="self"``: over a group of this rank alone, made
with ``dist.new_group([rank])`` by every rank for every rank, as ``new_group`` is
collective), the logged loss an ``all_reduce`` over its group, or, for ``loss_group="tp"``,
``DTensor.from_local(share, mesh["tp"], [Replicate()]).full_tensor()`` — the call whose
missing DP reduction pytorch/torchtitan issue 3280 reported.

``mesh_rank_check`` runs one check of a mode on every rank; rank 0 gathers every rank's step
and reports the five measures exactly as ``tpattn.run(seed, mode, cfg, "ranks")`` does
(``tpattn.parallel.simulated.mesh_view``), plus how far the DP replicas' gradients and
weights are apart. ``mesh_run_rank`` is ``tpattn.real.ranks.run_rank`` for a Config with
``data_parallel > 1``.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpattn.bugs.zoo import (block_inputs, check_needs, dense_step, make_params, rank_batches,
                             shard, unshard)
from tpattn.bugs.modes import resolve
from tpattn.check.core import (LR, check_seed, dropout_masks, five_measures, make_inputs,
                               max_abs_diff)
from tpattn.config import Config
from tpattn.parallel.collectives import DP_GRAD_LABEL, SimulatedRanks
from tpattn.parallel.rng import process_streams
from tpattn.parallel.engine import stack_ranks, train_step
from tpattn.parallel.simulated import mesh_view, replica_views

__all__ = ["MeshRanks", "build_mesh", "mesh_rank_step", "gather_mesh_step", "mesh_rank_check",
           "mesh_run_rank", "replica_disagreement", "check_mesh_config"]


def check_mesh_config(cfg: Config) -> Config:
    """``cfg`` if real ranks can run its mesh, else ``ValueError`` naming the rule: the real
    mesh holds every KV head on its TP rank (``kv_heads >= world_size``)."""
    if cfg.kv_heads < cfg.world_size:
        raise ValueError(f"a TP x DP mesh on real ranks needs kv_heads >= world_size (got "
                         f"kv_heads={cfg.kv_heads}, world_size={cfg.world_size})")
    return cfg


def build_mesh(cfg: Config, timeout: float = 60.0):
    """Inside an initialized default group of ``cfg.ranks`` processes: the ``("dp", "tp")``
    DeviceMesh and this rank's group of one (every rank makes every rank's, in order)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (cfg.data_parallel, cfg.world_size),
                            mesh_dim_names=("dp", "tp"))
    mine = None
    for r in range(cfg.ranks):
        group = dist.new_group([r], timeout=timedelta(seconds=timeout))
        if r == dist.get_rank():
            mine = group
    return mesh, mine


class MeshRanks(SimulatedRanks):
    """``SimulatedRanks`` for this real rank of a TP x DP mesh (``R = 1``): the same
    collectives and ledger entries, each group operation a real collective (module
    docstring). ``mesh``, ``self_group``: ``build_mesh``'s; ``ledger``: a list."""

    def __init__(self, cfg: Config, mesh, self_group, ledger: list | None = None):
        super().__init__(cfg, ledger)
        self.mesh, self.rank = mesh, dist.get_rank()
        self.ranks = [self.rank % cfg.world_size]
        self.dp_ranks = [self.rank // cfg.world_size]
        self.process_groups = {"tp": mesh.get_group("tp"), "dp": mesh.get_group("dp"),
                               "world": dist.group.WORLD, "self": self_group}

    def position(self, entry: int, group: str = "tp") -> int:
        """This rank's rank inside its group of ``group``."""
        return dist.get_rank(self.process_groups[group])

    def group_sum(self, t: torch.Tensor, group: str = "tp") -> torch.Tensor:
        """``all_reduce`` (SUM) of ``t`` ``[1, ...]`` over this rank's group of ``group``."""
        out = t.detach().contiguous().clone()
        dist.all_reduce(out, group=self.process_groups[group])
        return out

    def group_cat(self, t: torch.Tensor, dim: int, group: str = "tp") -> torch.Tensor:
        """``all_gather`` of ``t`` ``[1, ...]`` over the group, concatenated along ``dim`` of
        the entry (group order)."""
        pg = self.process_groups[group]
        local = t[0].detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(parts, local, group=pg)
        return torch.cat(parts, dim=dim).unsqueeze(0)

    def scatter_sum(self, t: torch.Tensor, group: str = "tp") -> torch.Tensor:
        """``reduce_scatter_single`` along the sequence: this rank's tokens of the group's
        sum of ``t`` ``[1, S, ...]``."""
        pg = self.process_groups[group]
        full = t[0].detach().contiguous()
        local = full.new_empty((full.shape[0] // dist.get_world_size(pg), *full.shape[1:]))
        dist.reduce_scatter_single(local, full, group=pg)
        return local.unsqueeze(0)

    def reduce_dp_grads(self, grads: dict[str, torch.Tensor],
                        group: str = "dp") -> dict[str, torch.Tensor]:
        """The DP gradient all-reduce: every gradient in one flat buffer, ``all_reduce`` SUM
        over the DP group, or over this rank's group of one (``"self"``: a real collective
        that changes nothing)."""
        if group not in ("dp", "self"):
            raise ValueError(f"group must be 'dp' or 'self' (got {group!r})")
        self.record("after backward", DP_GRAD_LABEL, group=group)
        flat = torch.cat([g.detach().reshape(-1) for g in grads.values()])
        dist.all_reduce(flat, group=self.process_groups[group])
        sizes = [g.numel() for g in grads.values()]
        return {k: part.view_as(g) for (k, g), part in zip(grads.items(), flat.split(sizes))}

    def reduce_loss(self, share: torch.Tensor, group: str = "dp") -> torch.Tensor:
        """The logged loss: ``all_reduce`` SUM of ``share`` ``[1]`` over ``group``; for
        ``"tp"`` the loss as a Replicate DTensor on the TP mesh, ``full_tensor()``."""
        if group != "tp":
            return super().reduce_loss(share, group)
        from torch.distributed.tensor import DTensor, Replicate

        loss = DTensor.from_local(share.detach().reshape(()), self.mesh["tp"], [Replicate()])
        return loss.full_tensor().reshape(1)


def mesh_rank_step(seed: int, mode: str, cfg: Config, comm: MeshRanks) -> dict:
    """This rank's ``engine.train_step`` of ``mode``'s injection: its TP shard, its replica's
    batch (``rank_batches``, ``block_inputs``), ``[1, ...]`` tensors in its dict; with dropout,
    this process's random streams (``rng.process_streams``: torch's global RNG is the default
    stream)."""
    check_seed(seed)
    entry = resolve(mode, cfg)  # looked up once; the zoo's modes also meet their needs
    inj = entry.injection if entry.injection.reduction_only else check_needs(mode, cfg).injection
    rank = comm.rank
    base = make_params(cfg, seed, inj)
    mine = shard(base, cfg, inj)[rank % cfg.world_size]
    x, target = block_inputs(rank_batches(cfg, seed, inj), cfg)[rank]
    rng = process_streams(cfg, seed, rank % cfg.world_size, inj) if cfg.dropout > 0 else None
    return train_step(stack_ranks([mine]), x.unsqueeze(0), target.unsqueeze(0), cfg, inj, comm,
                      LR, rng)


def gather_mesh_step(step: dict) -> dict:
    """Every rank's ``mesh_rank_step`` put together in mesh order (``all_gather_object`` over
    the world), as ``simulated.simulated_step`` returns it for the whole mesh (``ledger``:
    rank 0's)."""
    mine = {k: step[k] for k in ("outputs", "losses", "input_grads", "grads", "weights")}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    cat = torch.cat
    return {"outputs": cat([p["outputs"] for p in parts]),
            "losses": cat([p["losses"] for p in parts]),
            "input_grads": cat([p["input_grads"] for p in parts]),
            "grads": {k: cat([p["grads"][k] for p in parts]) for k in mine["grads"]},
            "weights": {k: cat([p["weights"][k] for p in parts]) for k in mine["weights"]},
            "grad_norm": step["grad_norm"], "ledger": step["ledger"]}


def replica_disagreement(step: dict, cfg: Config, unshard_fn=None) -> dict:
    """How far DP replicas 1.. are from replica 0 (max abs difference over parameters):
    ``dp_replica_grad_max_diff`` and ``dp_replica_weight_max_diff`` (0 when the DP gradient
    all-reduce runs)."""
    views = replica_views(step, cfg, unshard_fn)
    return {f"dp_replica_{kind[:-1]}_max_diff": max(
        max_abs_diff(v[kind][k], views[0][kind][k]) for v in views[1:] for k in views[0][kind])
        for kind in ("grads", "weights")}


def mesh_rank_check(seed: int, mode: str, cfg: Config, comm: MeshRanks):
    """One check of ``mode`` on every rank of the mesh: ``(metrics, disagreement, step)`` on
    rank 0 (``run(seed, mode, cfg, "ranks")``'s dict, ``replica_disagreement``, the whole
    mesh's gathered step), ``(None, None, None)`` elsewhere."""
    step = gather_mesh_step(mesh_rank_step(seed, mode, cfg, comm))
    if comm.rank != 0:
        return None, None, None
    inj = resolve(mode, cfg).injection
    base = make_params(cfg, seed, inj)
    gather = lambda per_rank: unshard(per_rank, cfg, inj)  # noqa: E731
    x0, target = make_inputs(cfg, seed)
    dense = dense_step(x0, target, base, cfg, inj, dropout_masks(cfg, seed))
    metrics = five_measures(seed, mode, dense, mesh_view(step, cfg, gather))
    return metrics, {"seed": seed, "mode": mode,
                     **replica_disagreement(step, cfg, gather)}, step


def mesh_run_rank(rank: int, plan, device: torch.device | str = "cpu", on_progress=None) -> dict:
    """``tpattn.real.ranks.run_rank`` for a plan whose Config has ``data_parallel > 1``: the
    mesh (``build_mesh``), every job with ``mesh_rank_check``; rank 0 returns ``results``,
    ``rank_disagreement`` (the DP replicas'), ``ledger`` (per mode its entries, the simulated
    ledger's form), empty ``dtensor`` and ``traffic``; every rank ``issued`` and
    ``compute_s``."""
    start = time.monotonic()
    cfg = check_mesh_config(plan.cfg)
    mesh, mine = build_mesh(cfg, plan.timeout)
    out = {"results": [], "rank_disagreement": [], "ledger": [], "dtensor": [], "traffic": []}
    issued = 0
    for index, (mode, seed) in enumerate(plan.jobs):
        comm = MeshRanks(cfg, mesh, mine, [])
        metrics, disagreement, _ = mesh_rank_check(seed, mode, cfg, comm)
        issued += len(comm.ledger)
        if rank == 0:
            out["results"].append(metrics)
            out["rank_disagreement"].append(disagreement)
            if mode not in {row["mode"] for row in out["ledger"]}:
                out["ledger"].append({"variant": "tpattn TP x DP", "mode": mode,
                                      "entries": comm.ledger})
        if on_progress:
            on_progress(index)
    if rank != 0:
        out = {}
    out["issued"] = issued
    out["compute_s"] = time.monotonic() - start
    return out
