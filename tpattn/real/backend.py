"""One real torch.distributed rank as the engine's backend: ``SimulatedRanks`` with R = 1 whose
group primitives are ``all_reduce``, ``all_gather`` and ``reduce_scatter_single``; each issues
only what the plan says comes next and names its ledger entry when it fails."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpattn.block.kv_layout import kv_grad_bug_applies
from tpattn.config import Config
from tpattn.parallel.collectives import SimulatedRanks
from .launch import backend_message

__all__ = ["CollectiveError", "build_groups", "RealRanks", "gather_step", "GATHER_LABEL"]

#: Label of the all-gather that brings every rank's step to every rank (errors name it).
GATHER_LABEL = "all-gather of every rank's step"


class CollectiveError(RuntimeError):
    """A collective failed; ``deviation``: how this rank had left the plan before, or ``None``."""

    in_collective = True

    def __init__(self, message: str, deviation: str | None = None):
        super().__init__(message)
        self.deviation = deviation


def build_groups(cfg: Config, device_type: str = "cpu", timeout: float = 60.0) -> dict:
    """This rank's ``"mesh"`` (``("dp", "tp")``, rank ``dp * W + tp``), ``"tp"``, ``"dp"``,
    ``"world"`` groups, and as needed ``"kv_replicas"`` and ``"self"`` (made on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (cfg.data_parallel, cfg.world_size),
                            mesh_dim_names=("dp", "tp"))
    groups = {"mesh": mesh, "tp": mesh.get_group("tp"), "dp": mesh.get_group("dp"),
              "world": dist.group.WORLD}
    named = (["kv_replicas"] if kv_grad_bug_applies(cfg) else []) \
        + (["self"] if cfg.data_parallel > 1 else [])
    for name in named:
        for members in SimulatedRanks(cfg).groups(name):
            handle = dist.new_group(members, timeout=timedelta(seconds=timeout))
            if dist.get_rank() in members:
                groups[name] = handle
    return groups


class RealRanks(SimulatedRanks):
    """``SimulatedRanks`` for rank ``rank``, tensors ``[1, ...]``; ``plan``: its expected ledger,
    ``traffic``: ``{"label", "phase", "kind", "group_size", "elements"}`` per collective."""

    def __init__(self, cfg: Config, groups: dict, rank: int, plan: list | None = None,
                 job: str = ""):
        super().__init__(cfg, [])
        self.process_groups, self.rank, self.plan, self.job = groups, rank, plan, job
        self.ranks, self.dp_ranks = [rank % cfg.world_size], [rank // cfg.world_size]
        self.traffic = []

    def deviation(self) -> str | None:
        """How the ledger so far strays from ``plan``, or ``None``."""
        for index, entry in enumerate(self.ledger if self.plan is not None else []):
            planned = self.plan[index] if index < len(self.plan) else None
            if entry != planned:
                return (f"it issued {entry['label']} as collective #{index + 1} of {self.job} "
                        f"where the plan has {planned['label'] if planned else 'nothing more'}")
        return None

    def check_plan(self) -> None:
        """Raise ``RuntimeError`` unless the ledger is exactly ``plan``."""
        problem = self.deviation()
        if problem is None and len(self.ledger) != len(self.plan):
            problem = (f"it issued {len(self.ledger)} of the {len(self.plan)} planned "
                       f"collectives of {self.job}")
        if problem:
            raise RuntimeError("collectives out of plan: " + problem)

    def issue(self, collective, *args, group: str = "tp", elements: int | None = None):
        """``collective(*args, group=...)`` for the last ledger entry (``elements=None``: the
        step gather), counted in ``traffic``; ``CollectiveError`` naming it if it fails or the
        ledger has left the plan."""
        pg = self.process_groups[group]
        entry = self.ledger[-1] if elements is not None else {"label": GATHER_LABEL}
        where = f"{entry['label']} (collective #{len(self.ledger)} of {self.job})"
        strayed = self.deviation()
        if strayed:  # never issue out of plan: a peer would pair it with another collective
            raise CollectiveError(f"{where} not issued: this rank left the plan", strayed)
        if elements is not None:
            self.traffic.append({"label": entry["label"], "phase": entry["phase"],
                                 "kind": entry["collective"],
                                 "group_size": dist.get_world_size(pg), "elements": elements})
        try:
            return collective(*args, group=pg)
        except Exception as e:  # name the collective; keep what the backend said
            raise CollectiveError(f"{where} failed: {backend_message(e)}") from e

    def position(self, entry: int, group: str = "tp") -> int:
        """This rank's rank inside its group of ``group``."""
        return dist.get_rank(self.process_groups[group])

    def group_sum(self, t: torch.Tensor, group: str = "tp") -> torch.Tensor:
        """``all_reduce`` (SUM) of ``t`` ``[1, ...]`` over this rank's group of ``group``."""
        out = t.detach().contiguous().clone()
        self.issue(dist.all_reduce, out, group=group, elements=out.numel())
        return out

    def group_cat(self, t: torch.Tensor, dim: int, group: str = "tp") -> torch.Tensor:
        """``all_gather`` over the group: its ranks' entries ``t[0]`` in order, along ``dim``."""
        local = t[0].detach().contiguous()
        parts = [torch.empty_like(local)
                 for _ in range(dist.get_world_size(self.process_groups[group]))]
        self.issue(dist.all_gather, parts, local, group=group,
                   elements=local.numel() * len(parts))
        return torch.cat(parts, dim=dim).unsqueeze(0)

    def scatter_sum(self, t: torch.Tensor, group: str = "tp") -> torch.Tensor:
        """``reduce_scatter_single``: this rank's ``S/W`` chunk of the group's sum of ``t``."""
        full = t[0].detach().contiguous()
        size = dist.get_world_size(self.process_groups[group])
        local = full.new_empty((full.shape[0] // size, *full.shape[1:]))
        self.issue(dist.reduce_scatter_single, local, full, group=group,
                   elements=full.numel())
        return local.unsqueeze(0)


def gather_step(step: dict, comm: RealRanks, targets: torch.Tensor) -> dict:
    """Every rank's ``train_step`` dict stacked in mesh order (one ``all_gather_object``), as
    ``simulated_step`` returns it; ``targets`` ``[R, S_r, B, hidden]`` give SP's global MSE."""
    keys = ("outputs", "losses", "input_grads", "grads", "weights")
    mine = {k: ({n: t.cpu() for n, t in step[k].items()} if isinstance(step[k], dict)
                else step[k].cpu()) for k in keys}
    parts = [None] * dist.get_world_size()
    comm.issue(dist.all_gather_object, parts, mine, group="world")
    out = {k: (torch.cat([p[k] for p in parts]) if k not in ("grads", "weights")
               else {n: torch.cat([p[k][n] for p in parts]) for n in mine[k]}) for k in keys}
    if comm.cfg.sequence_parallel and comm.cfg.data_parallel == 1:
        out["losses"] = F.mse_loss(out["outputs"], targets, reduction="sum").div(
            targets.numel()).expand(targets.shape[0])
    return {**out, "grad_norm": step["grad_norm"], "ledger": step["ledger"]}
