"""The decoder LM on real ranks through ``run_on_ranks``: each process runs ``tp_lm_step`` of a
mode's ``LMProgram`` (``tpattn.bugs.lm_zoo``) on ``RealRanks`` held to the ledger the simulated
step plans; rank 0 returns, per job, its ledger and the five measures against the dense step
(judged) and against the simulated ranks' step."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tpattn.bugs.lm_zoo import LM_EQUIVALENCE, lm_case, lm_program
from tpattn.check.core import LR, check_seed
from tpattn.check.lm import judge_lm
from tpattn.check.measures import five_measures
from tpattn.model.config import LMConfig
from tpattn.model.job import dense_lm_job, lm_inputs, simulated_lm_job
from tpattn.model.tp import LM_CORRECT, LMProgram, gather_lm_step, tp_lm_step
from tpattn.parallel.engine import stack_ranks
from .backend import RealRanks, build_groups, gather_step
from .launch import DEFAULT_TIMEOUT, default_backend, run_on_ranks

__all__ = ["LMRunPlan", "plan_lm_run", "lm_rank_step", "run_lm_rank",
           "run_lm_distributed"]


@dataclass(frozen=True)
class LMRunPlan:
    """What every rank runs (picklable): ``jobs`` ``(LMConfig, seed, mode)``, one world size;
    ``mode`` the mode of the jobs given as ``(LMConfig, seed)`` pairs."""

    jobs: tuple[tuple[LMConfig, int, str], ...]
    lr: float = LR
    timeout: float = DEFAULT_TIMEOUT
    mode: str = LM_EQUIVALENCE


def _job(job, mode: str) -> tuple[LMConfig, int, str]:
    """One job as ``(LMConfig, seed, mode)``: a pair takes ``mode``; ``ValueError`` otherwise."""
    if not isinstance(job, tuple) or len(job) not in (2, 3) \
            or not isinstance(job[0], LMConfig):
        raise ValueError("jobs must be a non-empty sequence of (LMConfig, seed) pairs or "
                         f"(LMConfig, seed, mode) triples (got {job!r})")
    lm, seed, mode = (*job, mode)[:3]
    lm_program(mode)  # raises naming the LM modes for any other name
    return lm, check_seed(seed), mode


def plan_lm_run(jobs, lr: float = LR, timeout: float = DEFAULT_TIMEOUT,
                mode: str = LM_EQUIVALENCE) -> LMRunPlan:
    """``run_lm_distributed``'s arguments checked: the ``LMRunPlan`` every rank runs."""
    jobs = tuple(_job(job, mode) for job in jobs)
    if not jobs:
        raise ValueError("jobs must be a non-empty sequence of (LMConfig, seed) pairs or "
                         "(LMConfig, seed, mode) triples")
    if len({lm.block.world_size for lm, _, _ in jobs}) > 1:
        raise ValueError("jobs must share one block.world_size, the number of processes "
                         f"(got {sorted({lm.block.world_size for lm, _, _ in jobs})})")
    for name, value in (("lr", lr), ("timeout", timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0 (got {value!r})")
    return LMRunPlan(jobs, float(lr), float(timeout), mode)


def lm_rank_step(lm: LMConfig, seed: int, lr: float, comm: RealRanks, device="cpu",
                 prog: LMProgram = LM_CORRECT) -> dict:
    """This rank's ``tp_lm_step`` of ``prog`` on ``comm`` (its shard from the program's
    ``shard`` stage), then every rank's gathered:
    tensors ``[W, ...]`` as ``simulated_lm_job`` returns them."""
    p, tokens = lm_inputs(lm, seed)
    shard = prog.shard
    mine = {k: t.to(device) for k, t in stack_ranks([shard(p, lm)[comm.rank]]).items()}
    step = tp_lm_step(mine, tokens.to(device).unsqueeze(0), lm, comm, lr, prog)
    return gather_step(step, comm, None)


def run_lm_rank(rank: int, plan: LMRunPlan, device: torch.device | str = "cpu",
                on_progress=None, groups: dict | None = None) -> list[dict]:
    """Every job of ``plan`` on this rank of an initialized group; on rank 0 one dict per job:
    ``seed``, ``mode``, ``ledger``, ``grad_norm``, ``measures`` (against the dense step,
    ``judge_lm``'s verdict), ``vs_simulated`` (the five differences from ``simulated_lm_job``'s
    step of the same program); else ``[]``."""
    cfg = plan.jobs[0][0].block
    groups = groups or build_groups(cfg, torch.device(device).type, plan.timeout)
    out = []
    for index, (lm, seed, mode) in enumerate(plan.jobs):
        lm, prog, clip = lm_case(mode, lm)
        simulated = simulated_lm_job(lm, seed, plan.lr, prog)
        comm = RealRanks(lm.block, groups, rank, simulated["ledger"], f"seed {seed} {mode}")
        step = lm_rank_step(lm, seed, plan.lr, comm, device, prog)
        comm.check_plan()
        if rank == 0:
            view = gather_lm_step(step, lm)
            dense = dense_lm_job(lm, seed, plan.lr, clip)
            out.append({"seed": seed, "mode": mode, "ledger": comm.ledger,
                        "grad_norm": step["grad_norm"],
                        "measures": judge_lm(seed, mode, lm, dense, view, plan.lr),
                        "vs_simulated": five_measures(seed, mode,
                                                      gather_lm_step(simulated, lm), view)})
        if on_progress:
            on_progress(index)
    return out


def run_lm_distributed(jobs, *, lr: float = LR, timeout: float = DEFAULT_TIMEOUT,
                       backend: str | None = None, start_method: str = "forkserver",
                       mode: str = LM_EQUIVALENCE) -> list[dict]:
    """Start ``block.world_size`` processes, run every ``(LMConfig, seed[, mode])`` job of
    ``jobs`` (a pair runs ``mode``) in one process group; rank 0's ``run_lm_rank`` list. A
    failing rank raises ``RankFailure``."""
    plan = plan_lm_run(jobs, lr, timeout, mode)
    world_size = plan.jobs[0][0].block.world_size
    results, _ = run_on_ranks(run_lm_rank, world_size, plan, timeout=plan.timeout,
                              backend=backend or default_backend(world_size),
                              start_method=start_method, preload=("tpattn.real.lm_ranks",))
    return results[0]
