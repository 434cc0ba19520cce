"""``torchrun -m tpattn.distributed``: the CLI on real ranks, ``python -m tpattn``'s flags and
JSON plus ``--timeout``; ``--model lm`` runs the decoder LM's modes (``tpattn.real.lm_ranks``)."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from tpattn.bugs.lm_zoo import LM_EQUIVALENCE
from tpattn.bugs.modes import modes_for
from tpattn.check.core import inspect_fixture
from tpattn.cli import build_parser, config_from_args, modes_listing, print_results
from tpattn.cli_lm import check_block_args, check_lm_args, lm_config, lm_jobs, lm_listing, \
    lm_result
from tpattn.config import Config
from tpattn.real.launch import RankFailure, default_backend, describe_error, run_on_ranks
from tpattn.real.lm_ranks import LMRunPlan, plan_lm_run, run_lm_rank
from tpattn.real.ranks import (DEFAULT_TIMEOUT, RunPlan, launched_by_torchrun, plan_run, run_rank,
                               run_under_torchrun)

__all__ = ["build_distributed_parser", "distributed_main"]


def build_distributed_parser(prog: str):
    """``tpattn.cli``'s parser (same flags, same one-line errors) plus ``--timeout``."""
    ap = build_parser(prog, simulated=False)
    ap.description = (
        "The tpattn check on real torch.distributed ranks, one process per TP rank (gloo on CPU, "
        "NCCL with one GPU per rank). Under torchrun it joins torchrun's processes; run with "
        "python it starts --world-size ranks itself. Prints python -m tpattn's JSON.")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                    help="how long any collective may wait before the run fails (default: %(default)s)")
    return ap


def _config_for_processes(args, torchrun: bool) -> Config:
    """The flags' ``Config``; under torchrun, ``ValueError`` unless its ranks are torchrun's."""
    cfg = config_from_args(args)
    if torchrun and cfg.ranks != int(os.environ["WORLD_SIZE"]):
        what = (f"world_size must equal the number of processes: --world-size is "
                f"{cfg.world_size}" if cfg.data_parallel == 1 else
                f"world_size * data_parallel must equal the number of processes: --tp is "
                f"{cfg.world_size} and --dp {cfg.data_parallel}")
        raise ValueError(f"{what} but torchrun started {os.environ['WORLD_SIZE']} "
                         f"(set --nproc-per-node to match)")
    return cfg


def _run_plan(plan: RunPlan, diagnose: bool, torchrun: bool) -> dict:
    """Run ``plan`` on real ranks (under torchrun, or started here); rank 0's dict."""
    rank_fn = run_rank
    if diagnose:
        from tpattn.diagnosis.observe_real import diagnose_rank as rank_fn
    backend = default_backend(plan.cfg.ranks)
    if torchrun:
        return run_under_torchrun(plan, backend, rank_fn)
    if not diagnose:  # each (mode, seed) once
        plan = replace(plan, jobs=tuple(dict.fromkeys(plan.jobs)))
    return run_on_ranks(rank_fn, plan.cfg.ranks, plan, timeout=plan.timeout, backend=backend,
                        preload=(rank_fn.__module__,))[0][0]


def _run_lm_plan(plan: LMRunPlan, torchrun: bool) -> list[dict]:
    """Run ``plan`` on real ranks (under torchrun, or started here); rank 0's list."""
    backend = default_backend(plan.jobs[0][0].block.ranks)
    if torchrun:
        return run_under_torchrun(plan, backend, run_lm_rank)
    return run_on_ranks(run_lm_rank, plan.jobs[0][0].block.ranks, plan, timeout=plan.timeout,
                        backend=backend, preload=(run_lm_rank.__module__,))[0][0]


def lm_distributed_main(args, torchrun: bool, rank: int, fail) -> int:
    """``--model lm`` on real ranks: ``python -m tpattn --model lm``'s JSON from rank 0 (each
    result's ``measures`` as ``cli_lm.lm_result``); ``fail(code, message)`` reports an error and
    returns its exit code (2 for bad input, 1 when a rank failed)."""
    if args.list_modes:
        print(json.dumps(lm_listing(), indent=2))
        return 0
    try:
        cfg = _config_for_processes(args, torchrun)
        check_lm_args(args, real=True)
        plan = plan_lm_run(lm_jobs(args, lm_config(args, cfg)), timeout=args.timeout)
    except ValueError as e:
        return fail(2, e)
    try:
        results = _run_lm_plan(plan, torchrun)
    except RankFailure as e:  # started by us: the launcher's line names the rank
        return fail(1, e)
    except RuntimeError as e:  # under torchrun: this rank failed (in a collective, or itself)
        return fail(1, f"rank {rank}: {describe_error(e)}")
    if rank != 0:
        return 0
    out = [lm_result(r["measures"]) for r in results]
    return print_results(out if args.mode == "matrix" else out[0], args.strict, LM_EQUIVALENCE)


def distributed_main(argv: list[str] | None = None, prog: str = "tpattn.distributed") -> int:
    """Run the CLI; the exit code as ``tpattn.cli``'s, 1 also when a rank failed."""
    ap = build_distributed_parser(prog)
    args = ap.parse_args(argv)
    if args.list_modes and args.model == "block":
        print(json.dumps(modes_listing(), indent=2))
        return 0
    torchrun = launched_by_torchrun()
    rank = int(os.environ["RANK"]) if torchrun else 0

    def fail(code: int, message) -> int:
        if rank == 0 or code != 2:  # a bad flag is the same on every rank: say it once
            print(f"{prog}: error: {message}", file=sys.stderr)
        return code

    if args.model == "lm":
        return lm_distributed_main(args, torchrun, rank, fail)
    try:
        check_block_args(args)
        cfg = _config_for_processes(args, torchrun)
        if args.mode == "inspect":
            out = inspect_fixture(cfg)
        else:
            seeds, modes = (args.seeds, modes_for(cfg)) if args.mode == "matrix" \
                else ([args.seed], [args.mode])
            plan = plan_run(cfg.world_size, seeds, modes, cfg, args.timeout)
    except ValueError as e:
        return fail(2, e)
    if args.mode != "inspect":
        try:
            report = _run_plan(plan, args.diagnose, torchrun)
        except RankFailure as e:  # started by us: the launcher's line names the rank
            return fail(1, e)
        except RuntimeError as e:  # under torchrun: this rank failed (in a collective, or itself)
            return fail(1, f"rank {rank}: {describe_error(e)}")
        results = report.get("results")
        for result, diagnosis in zip(results or [], report.get("diagnoses", [])):
            result["diagnosis"] = diagnosis
        out = results if args.mode == "matrix" else (results[0] if results else None)
    return print_results(out, args.strict) if rank == 0 else 0


if __name__ == "__main__":
    # hide this __main__ copy from multiprocessing so that the ranks do not re-run it
    __spec__ = None
    del __file__
    from tpattn.distributed import distributed_main as _main

    sys.exit(_main(prog="tpattn.distributed"))
