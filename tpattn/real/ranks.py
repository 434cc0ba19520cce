"""The check on real ranks: one torch.distributed process per rank, each running
``engine.train_step`` on ``backend.RealRanks`` with the ledger ``SimulatedRanks`` plans; rank 0
reports the five measures, replica disagreement and the collectives (``RealRankReport``)."""
from __future__ import annotations

import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from tpattn.block.kv_layout import has_replicas, kv_grad_bug_applies, replica_groups
from tpattn.block.params import QK_NORM_NAMES
from tpattn.bugs.modes import resolve
from tpattn.check.core import (EQUIVALENCE, LR, MODES, SEEDS, block_inputs, check_count,
                               check_seed,
                               dense_step, dropout_masks, five_measures, make_inputs,
                               make_params, max_abs_diff, rank_batches, shard, unshard)
from tpattn.config import Config
from tpattn.parallel.engine import stack_ranks, train_step
from tpattn.parallel.rng import process_streams, simulated_streams
from tpattn.parallel.sequence_parallel import ring_bytes
from tpattn.parallel.simulated import mesh_view, rank0_view, replica_views, simulated_step
from .backend import RealRanks, build_groups, gather_step
from .launch import (DEFAULT_TIMEOUT, RankFailure, default_backend, describe_error,
                     pin_gloo_to_loopback, rank_device, run_on_ranks)

__all__ = ["job_setup", "planned_ledger", "rank_step", "rank_disagreement",
           "ledger_row", "run_rank", "dtensor_jobs", "RunPlan", "run_distributed",
           "RealRankReport", "RankFailure", "default_backend", "DEFAULT_TIMEOUT", "FAULT_KINDS",
           "plan_run", "launched_by_torchrun", "run_under_torchrun"]

#: What the faulty rank does under the test-only ``run_distributed(fault=...)``.
FAULT_KINDS = ("raise", "exit_early", "skip_collective")
#: The phases of the block's own collectives (``RealRankReport.traffic``, the ledger rows).
BLOCK_PHASES = ("forward", "backward", "after backward")
#: The lists rank 0 reports (``RealRankReport``'s fields).
REPORT_LISTS = ("results", "rank_disagreement", "ledger", "dtensor", "traffic")
#: DTensor's plan: RowwiseParallel(wo) sums once in forward, each ColwiseParallel (wq, wk, wv)
#: once in backward.
DTENSOR_EXPECTED_ALL_REDUCES = {"forward": 1, "backward": 3}


def job_setup(seed: int, mode: str, cfg: Config):
    """``(inj, base, shards, batches)`` of ``mode``: one shard and batch per rank, as
    ``tpattn.run(seed, mode, cfg, "ranks")`` gets them."""
    inj = resolve(mode, cfg).injection
    base = make_params(cfg, seed, inj)
    shards = shard(base, cfg, inj) * cfg.data_parallel
    return inj, base, shards, block_inputs(rank_batches(cfg, seed, inj), cfg)


def planned_ledger(mode: str, cfg: Config, seed: int = 11) -> list[dict]:
    """The ledger of one step of ``mode`` on ``SimulatedRanks``: what every rank issues."""
    inj, _, shards, batches = job_setup(seed, mode, cfg)
    rng = simulated_streams(cfg, seed, inj) if cfg.dropout > 0 else None
    return simulated_step(shards, batches, cfg, inj, LR, rng=rng)["ledger"]


def rank_step(seed: int, mode: str, cfg: Config, comm: RealRanks, device="cpu",
              skip_output_reduce: bool = False):
    """This rank's ``train_step`` of ``mode`` on ``comm``, then every rank's step gathered:
    ``(step, inj, base)``. ``skip_output_reduce``: this rank drops g (a test's fault)."""
    inj, base, shards, batches = job_setup(seed, mode, cfg)
    x, target = (t.to(device).unsqueeze(0) for t in batches[comm.rank])
    mine = {k: t.to(device) for k, t in stack_ranks([shards[comm.rank]]).items()}
    rng = process_streams(cfg, seed, comm.rank % cfg.world_size, inj) if cfg.dropout else None
    program = replace(inj, g=0) if skip_output_reduce else inj
    step = train_step(mine, x, target, cfg, program, comm, LR, rng)
    return gather_step(step, comm, torch.stack([t for _, t in batches])), inj, base


def rank_disagreement(seed: int, mode: str, step: dict, cfg: Config, unshard_fn) -> dict:
    """Max abs difference from rank 0 where ranks should agree (``<name>_max_rank_diff``; SP:
    also ``norm_grad_by_rank``), across KV replicas and DP replicas (``*_replica_*_max_diff``)."""
    out = {"seed": seed, "mode": mode}
    if cfg.data_parallel > 1:
        views = replica_views(step, cfg, unshard_fn)
        return {**out, **{f"dp_replica_{kind[:-1]}_max_diff": max(
            max_abs_diff(v[kind][k], views[0][kind][k]) for v in views[1:] for k in views[0][kind])
            for kind in ("grads", "weights")}}
    grads, weights = step["grads"], step["weights"]
    named = {} if cfg.sequence_parallel else {"output": step["outputs"],
                                              "input_grad": step["input_grads"]}
    named.update({"norm_grad": grads["norm"], "norm_after_step": weights["norm"]})
    named.update({f"{k}_after_step": weights[k] for k in QK_NORM_NAMES if k in weights})
    for name, t in named.items():
        out[f"{name}_max_rank_diff"] = max(max_abs_diff(t[r], t[0]) for r in range(len(t)))
    if cfg.sequence_parallel:
        out["norm_grad_by_rank"] = grads["norm"].tolist()
    if kv_grad_bug_applies(cfg):
        for name, tensors in (("grad", grads), ("after_step", weights)):
            out[f"kv_replica_{name}_max_diff"] = max(
                max_abs_diff(tensors[w][r], tensors[w][group[0]])
                for group in replica_groups(cfg) for r in group for w in ("wk", "wv"))
    return out


def _all_reduces(entries: list[dict]) -> dict[str, int]:
    return {phase: sum(e["collective"] == "all_reduce" and e["phase"] == phase
                       for e in entries) for phase in ("forward", "backward")}


def _expected_actual(expected: dict[str, int], actual: dict[str, int]) -> dict[str, int]:
    """``{"forward_expected": n, "forward_actual": n, "backward_expected": ...}``."""
    return {f"{phase}_{which}": counts[phase] for phase in ("forward", "backward")
            for which, counts in (("expected", expected), ("actual", actual))}


def ledger_row(mode: str, comm: RealRanks, correct: list[dict]) -> dict:
    """Rank 0's collectives of ``mode``: on a mesh its ``entries``; SP: counts by ``"<phase>
    <kind>"`` and ``bytes_per_rank``; else all-reduces per phase vs ``correct``'s ledger."""
    cfg = comm.cfg
    if cfg.data_parallel > 1:
        return {"variant": "tpattn TP x DP", "mode": mode, "entries": comm.ledger}
    if cfg.sequence_parallel:
        block = [e for e in comm.ledger if e["phase"] in BLOCK_PHASES]
        counts = Counter((e["collective"], e["phase"]) for e in block)
        sent = sum((ring_bytes(r["kind"], r["elements"], r["group_size"], cfg.torch_dtype.itemsize)
                    for r in comm.traffic if r["phase"] in BLOCK_PHASES), 0.0)
        return {"variant": "tpattn SP", "mode": mode,
                **{f"{phase} {kind}": n for (kind, phase), n in sorted(counts.items())},
                "bytes_per_rank": sent}
    return {"variant": "tpattn f/g", "mode": mode,
            **_expected_actual(_all_reduces(correct), _all_reduces(comm.ledger))}


@dataclass(frozen=True)
class RunPlan:
    """What every rank runs (picklable): ``jobs`` ``(mode, seed)`` mode-major, the DTensor
    cross-check's seeds, the test-only ``fault``."""

    cfg: Config
    jobs: tuple[tuple[str, int], ...]
    dtensor_seeds: tuple[int, ...] = ()
    timeout: float = DEFAULT_TIMEOUT
    fault: dict | None = None


def _fault(plan: RunPlan, rank: int, index: int) -> bool:
    """The test-only fault on this rank's first job: raise or exit; returns whether to skip g."""
    if not plan.fault or plan.fault["rank"] != rank or index:
        return False
    if plan.fault["kind"] == "raise":
        raise RuntimeError("fault injected for a test: this rank raises")
    if plan.fault["kind"] == "exit_early":
        os._exit(0)  # silently, with a success code: the hardest death to notice
    return True


def run_rank(rank: int, plan: RunPlan, device: torch.device | str = "cpu", on_progress=None,
             groups: dict | None = None) -> dict:
    """Every job of ``plan`` on this rank of an initialized group (``groups``: default
    ``build_groups``'s). Returns ``compute_s`` and, on rank 0, ``REPORT_LISTS``."""
    start, cfg = time.monotonic(), plan.cfg
    groups = groups or build_groups(cfg, torch.device(device).type, plan.timeout)
    out = {k: [] for k in REPORT_LISTS}
    plans = {mode: planned_ledger(mode, cfg) for mode in {m for m, _ in plan.jobs}}
    for index, (mode, seed) in enumerate(plan.jobs):
        comm = RealRanks(cfg, groups, rank, plans[mode], f"seed {seed} {mode}")
        step, inj, base = rank_step(seed, mode, cfg, comm, device, _fault(plan, rank, index))
        comm.check_plan()
        if rank == 0:  # the five measures against the dense step, and where ranks disagree
            gather = partial(unshard, cfg=cfg, inj=inj)
            view = (mesh_view if cfg.data_parallel > 1 else rank0_view)(step, cfg, gather)
            x0, target = make_inputs(cfg, seed)
            dense = dense_step(x0, target, base, cfg, inj, dropout_masks(cfg, seed))
            out["results"].append(five_measures(seed, mode, dense, view))
            out["rank_disagreement"].append(rank_disagreement(seed, mode, step, cfg, gather))
            if mode not in {row["mode"] for row in out["ledger"]}:
                correct = plans[mode] if mode == EQUIVALENCE else planned_ledger(EQUIVALENCE, cfg)
                out["ledger"].append(ledger_row(mode, comm, correct))
                out["traffic"] += [{"mode": mode, **row} for row in comm.traffic
                                   if row["phase"] in BLOCK_PHASES]
        if on_progress:
            on_progress(index)
    if plan.dtensor_seeds:
        rows, ledger = dtensor_jobs(plan, device)
        out["dtensor"] += rows
        out["ledger"] += ledger
    return {**(out if rank == 0 else {}), "compute_s": time.monotonic() - start}


def dtensor_jobs(plan: RunPlan, device) -> tuple[list[dict], list[dict]]:
    """The DTensor cross-check of each seed: ``run()`` dicts (``{"seed", "error"}`` where it
    fails on replicated KV heads) and its ledger row."""
    cfg = plan.cfg
    from .dtensor_check import dtensor_check, parallelize_block as parallelize  # loads DTensor
    if cfg.sequence_parallel:
        from .dtensor_sp import parallelize_sp_block as parallelize
    rows, counts = [], None
    for seed in plan.dtensor_seeds:
        try:
            metrics, ledger = dtensor_check(seed, cfg, device, parallelize)
        except RuntimeError as e:  # ColwiseParallel splits a KV head: every rank fails alike
            if not has_replicas(cfg):
                raise
            metrics = {"seed": seed, "error": describe_error(e)}
        else:
            counts = counts or ledger
        rows.append(metrics)
    if counts is None:
        return rows, []
    if cfg.sequence_parallel:
        return rows, [{"variant": "DTensor SequenceParallel", "mode": EQUIVALENCE, **counts}]
    actual = {phase: counts.get(f"{phase} all_reduce", 0) for phase in ("forward", "backward")}
    return rows, [{"variant": "DTensor parallelize_module", "mode": EQUIVALENCE,
                   **_expected_actual(DTENSOR_EXPECTED_ALL_REDUCES, actual)}]


@dataclass
class RealRankReport:
    """Rank 0's view of a run: ``results`` (mode-major), ``rank_disagreement``, ``ledger``,
    ``dtensor``, ``timings`` (not deterministic), ``traffic`` (each mode's first job)."""

    world_size: int
    backend: str
    results: list[dict]
    rank_disagreement: list[dict]
    ledger: list[dict]
    dtensor: list[dict]
    timings: dict = field(default_factory=dict, compare=False)
    traffic: list[dict] = field(default_factory=list)


def _check_fault(fault, world_size: int, cfg: Config, jobs: bool) -> None:
    if not isinstance(fault, dict) or set(fault) != {"rank", "kind"}:
        raise ValueError(f"fault must be a dict with keys 'rank' and 'kind' (got {fault!r})")
    if fault["kind"] not in FAULT_KINDS:
        raise ValueError(f"fault kind must be one of {', '.join(FAULT_KINDS)} "
                         f"(got {fault['kind']!r})")
    if isinstance(fault["rank"], bool) or fault["rank"] not in range(world_size):
        raise ValueError(f"fault rank must be an integer in [0, {world_size}) "
                         f"(got {fault['rank']!r})")
    if not jobs:
        raise ValueError("fault needs at least one seed and one mode to run")
    if cfg.sequence_parallel or cfg.data_parallel > 1:
        raise ValueError("fault injection is not supported with config.sequence_parallel "
                         "or config.data_parallel > 1")


def plan_run(world_size, seeds, modes, config, timeout, fault=None, dtensor=False) -> RunPlan:
    """``run_distributed``'s arguments checked: the ``RunPlan`` every rank runs."""
    check_count("world_size", world_size)
    cfg = Config(world_size=world_size) if config is None else config
    if not isinstance(cfg, Config):
        raise ValueError(f"config must be a tpattn.Config (got {type(cfg).__name__})")
    if cfg.world_size != world_size:
        raise ValueError(f"world_size must equal config.world_size, the number of TP ranks "
                         f"(got world_size={world_size}, config.world_size={cfg.world_size})")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a finite number of seconds > 0 (got {timeout!r})")
    if isinstance(seeds, int) or isinstance(modes, str):
        raise ValueError("seeds and modes must be sequences (e.g. seeds=[11], modes=['equivalence'])")
    seeds = tuple(check_seed(s) for s in seeds)
    modes = tuple(modes)
    entries = [resolve(m, cfg) for m in modes]  # each mode checked, in order
    if any(e.injection is None or not e.injection.reduction_only for e in entries):
        for m in modes:
            resolve(m, cfg, strict=True)  # a mode this shape cannot run fails here, not in the ranks
    if fault is not None:
        _check_fault(fault, world_size, cfg, bool(modes and seeds))
    if cfg.data_parallel > 1 and cfg.kv_heads < cfg.world_size:
        raise ValueError(f"a TP x DP mesh on real ranks needs kv_heads >= world_size (got "
                         f"kv_heads={cfg.kv_heads}, world_size={cfg.world_size})")
    dtensor_seeds = (seeds if dtensor else ()) if isinstance(dtensor, bool) \
        else tuple(check_seed(s) for s in dtensor)
    return RunPlan(cfg=cfg, jobs=tuple((m, s) for m in modes for s in seeds),
                   dtensor_seeds=() if cfg.data_parallel > 1 else dtensor_seeds,
                   timeout=float(timeout), fault=dict(fault) if fault else None)


def run_distributed(world_size: int, seeds=SEEDS, modes=MODES, config: Config | None = None, *,
                    timeout: float = DEFAULT_TIMEOUT, dtensor=True, backend: str | None = None,
                    fault: dict | None = None, start_method: str = "forkserver") -> RealRankReport:
    """Start ``config.ranks`` processes (default ``Config(world_size=world_size)``), run every
    mode x seed and the DTensor cross-check (``dtensor``: ``True`` every seed, ``False``, or
    seeds; none on a mesh) in one process group; rank 0's report. ``start_method``:
    ``"forkserver"`` or ``"spawn"`` (from a script, call under ``if __name__ == "__main__":``).
    A collective waits at most ``timeout`` s; a failing rank raises ``RankFailure``. ``fault``
    (test-only): ``{"rank": r, "kind": k}``, ``k`` in ``FAULT_KINDS``."""
    plan = plan_run(world_size, seeds, modes, config, timeout, fault, dtensor)
    cfg = plan.cfg
    backend = backend or default_backend(cfg.ranks)
    preload = ("tpattn.real.ranks",) + (() if not plan.dtensor_seeds else (
        "tpattn.real.dtensor_sp",) if cfg.sequence_parallel else ("tpattn.real.dtensor_check",))
    results, timings = run_on_ranks(run_rank, cfg.ranks, plan, timeout=plan.timeout,
                                    backend=backend, start_method=start_method, preload=preload)
    rank0 = results[0]
    return RealRankReport(world_size, backend, **{k: rank0[k] for k in REPORT_LISTS},
                          timings={**timings, "compute_s": rank0["compute_s"]})


def launched_by_torchrun() -> bool:
    """Whether torchrun's environment variables are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def run_under_torchrun(plan: RunPlan, backend: str, rank_fn=run_rank) -> dict:
    """As one of torchrun's ranks: join its group, ``rank_fn(rank, plan, device)``, leave."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]:  # --standalone / one host
        pin_gloo_to_loopback()
    device = rank_device(backend, local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=plan.timeout))
    try:
        return rank_fn(rank, plan, device)
    finally:
        dist.destroy_process_group()
