"""The decoder LM on real ranks through ``run_on_ranks``: each process runs ``tp_lm_step`` on
``RealRanks`` held to the ledger the simulated step plans; rank 0 returns, per job, its ledger
and the five measures against the dense step (judged) and against the simulated ranks' step."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tpattn.check.core import EQUIVALENCE, LR, check_seed
from tpattn.check.lm import judge_lm
from tpattn.check.measures import five_measures
from tpattn.model.config import LMConfig
from tpattn.model.job import dense_lm_job, lm_inputs, simulated_lm_job
from tpattn.model.params import shard_lm_params
from tpattn.model.tp import gather_lm_step, tp_lm_step
from tpattn.parallel.engine import stack_ranks
from .backend import RealRanks, build_groups, gather_step
from .launch import DEFAULT_TIMEOUT, default_backend, run_on_ranks

__all__ = ["LMRunPlan", "plan_lm_run", "lm_rank_step", "run_lm_rank", "run_lm_distributed"]


@dataclass(frozen=True)
class LMRunPlan:
    """What every rank runs (picklable): ``jobs`` ``(LMConfig, seed)``, one world size."""

    jobs: tuple[tuple[LMConfig, int], ...]
    lr: float = LR
    timeout: float = DEFAULT_TIMEOUT


def plan_lm_run(jobs, lr: float = LR, timeout: float = DEFAULT_TIMEOUT) -> LMRunPlan:
    """``run_lm_distributed``'s arguments checked: the ``LMRunPlan`` every rank runs."""
    jobs = tuple((lm, check_seed(seed)) for lm, seed in jobs)
    if not jobs or not all(isinstance(lm, LMConfig) for lm, _ in jobs):
        raise ValueError("jobs must be a non-empty sequence of (LMConfig, seed) pairs")
    if len({lm.block.world_size for lm, _ in jobs}) > 1:
        raise ValueError("jobs must share one block.world_size, the number of processes "
                         f"(got {sorted({lm.block.world_size for lm, _ in jobs})})")
    for name, value in (("lr", lr), ("timeout", timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0 (got {value!r})")
    return LMRunPlan(jobs, float(lr), float(timeout))


def lm_rank_step(lm: LMConfig, seed: int, lr: float, comm: RealRanks, device="cpu") -> dict:
    """This rank's ``tp_lm_step`` on ``comm``, then every rank's gathered: tensors ``[W, ...]``
    as ``simulated_lm_job`` returns them."""
    p, tokens = lm_inputs(lm, seed)
    mine = {k: t.to(device) for k, t in stack_ranks([shard_lm_params(p, lm)[comm.rank]]).items()}
    step = tp_lm_step(mine, tokens.to(device).unsqueeze(0), lm, comm, lr)
    return gather_step(step, comm, None)


def run_lm_rank(rank: int, plan: LMRunPlan, device: torch.device | str = "cpu",
                on_progress=None, groups: dict | None = None) -> list[dict]:
    """Every job of ``plan`` on this rank of an initialized group; on rank 0 one dict per job:
    ``seed``, ``ledger``, ``grad_norm``, ``measures`` (against the dense step, ``judge_lm``'s
    verdict), ``vs_simulated`` (the five differences from ``simulated_lm_job``'s step); else
    ``[]``."""
    cfg = plan.jobs[0][0].block
    groups = groups or build_groups(cfg, torch.device(device).type, plan.timeout)
    out = []
    for index, (lm, seed) in enumerate(plan.jobs):
        simulated = simulated_lm_job(lm, seed, plan.lr)
        comm = RealRanks(lm.block, groups, rank, simulated["ledger"], f"seed {seed} LM")
        step = lm_rank_step(lm, seed, plan.lr, comm, device)
        comm.check_plan()
        if rank == 0:
            view = gather_lm_step(step, lm)
            dense = dense_lm_job(lm, seed, plan.lr)
            out.append({"seed": seed, "ledger": comm.ledger, "grad_norm": step["grad_norm"],
                        "measures": judge_lm(seed, EQUIVALENCE, lm, dense, view, plan.lr),
                        "vs_simulated": five_measures(seed, EQUIVALENCE,
                                                      gather_lm_step(simulated, lm), view)})
        if on_progress:
            on_progress(index)
    return out


def run_lm_distributed(jobs, *, lr: float = LR, timeout: float = DEFAULT_TIMEOUT,
                       backend: str | None = None, start_method: str = "forkserver") -> list[dict]:
    """Start ``block.world_size`` processes, run every ``(LMConfig, seed)`` job of ``jobs`` in
    one process group; rank 0's ``run_lm_rank`` list. A failing rank raises ``RankFailure``."""
    plan = plan_lm_run(jobs, lr, timeout)
    world_size = plan.jobs[0][0].block.world_size
    results, _ = run_on_ranks(run_lm_rank, world_size, plan, timeout=plan.timeout,
                              backend=backend or default_backend(world_size),
                              start_method=start_method, preload=("tpattn.real.lm_ranks",))
    return results[0]
