"""``python -m tpattn --model lm``: the decoder LM's five measures per mode of ``LM_REGISTRY``
(dense LM against the LM on simulated TP ranks, judged with the auto tolerance), the LM's flags
and their checks. ``tpattn.cli`` and ``tpattn.distributed`` call it."""
from __future__ import annotations

import argparse

from tpattn.bugs.lm_zoo import LM_EQUIVALENCE, LM_REGISTRY, lm_case, lm_mode_names
from tpattn.check.core import EQUIVALENCE, LR, check_seed
from tpattn.check.lm import judge_lm
from tpattn.check.measures import MEASURES
from tpattn.model.config import LMConfig
from tpattn.model.job import dense_lm_job, simulated_lm_job
from tpattn.model.tp import gather_lm_step

__all__ = ["MODELS", "LM_FLAGS", "add_lm_flags", "check_block_args", "lm_mode",
           "check_lm_args", "lm_config", "lm_listing", "lm_result", "lm_jobs", "run_lm",
           "run_lm_jobs", "lm_diagnosis", "lm_main"]

#: ``--model``'s choices: the attention block (the default), the decoder LM.
MODELS = ("block", "lm")
#: The LMConfig fields that have a flag, ``--vocab`` ... ``--tied``; ``None`` when not given.
LM_FLAGS = ("vocab", "layers", "ffn", "tied")


def add_lm_flags(ap: argparse.ArgumentParser) -> None:
    """``--model`` and the flags that set ``LMConfig`` fields (``lm_config`` reads them)."""
    lm = LMConfig()
    ap.add_argument("--model", choices=MODELS, default="block",
                    help="block: the attention block; lm: the decoder LM (vocabulary-parallel "
                         "embedding and cross-entropy, --layers blocks with a SwiGLU MLP), judged "
                         "with the auto tolerance on every rank's step (default: %(default)s)")
    for name in LM_FLAGS[:3]:
        ap.add_argument("--" + name, type=int, default=None, metavar="N",
                        help=f"--model lm: LMConfig.{name} (default: {getattr(lm, name)})")
    ap.add_argument("--tied", action="store_true", default=None,
                    help="--model lm: LMConfig.tied, the LM head tied to the embedding")


def check_block_args(args: argparse.Namespace) -> None:
    """``ValueError`` when a ``--model block`` run is given an LM flag or an LM-only mode."""
    given = [name for name in LM_FLAGS if getattr(args, name) is not None]
    if given:
        raise ValueError(f"--{given[0]} applies to --model lm only (got --model {args.model})")
    if args.mode in LM_REGISTRY:
        raise ValueError(f"mode {args.mode!r} is a mode of the LM: it runs with --model lm")


def lm_mode(mode: str) -> str:
    """``--mode`` under ``--model lm``: ``equivalence`` (the default) is ``LM_EQUIVALENCE``."""
    return LM_EQUIVALENCE if mode == EQUIVALENCE else mode


def check_lm_args(args: argparse.Namespace, real: bool = False) -> None:
    """``ValueError`` naming the flag when a ``--model lm`` run is given what the LM does not
    run: a mode outside ``LM_REGISTRY`` (and ``matrix``), ``--init``, ``--typecheck``, and on
    real ranks (``real``) ``--diagnose``."""
    if args.mode != "matrix" and lm_mode(args.mode) not in LM_REGISTRY:
        raise ValueError(f"mode must be matrix or one of the LM's modes {lm_mode_names()} "
                         f"with --model lm (got {args.mode!r})")
    if getattr(args, "init", "seed") != "seed":
        raise ValueError(f"--init applies to --model block only: the LM draws its own "
                         f"parameters (got --init {args.init})")
    if getattr(args, "typecheck", False):
        raise ValueError("--typecheck applies to --model block only (got --model lm)")
    if real and args.diagnose:
        raise ValueError("--diagnose with --model lm observes simulated ranks: run it with "
                         "python -m tpattn")


def lm_config(args: argparse.Namespace, block) -> LMConfig:
    """The ``LMConfig`` of ``block`` (the flags' ``Config``) and the LM flags given
    (``ValueError`` naming every broken rule)."""
    given = {name: getattr(args, name) for name in LM_FLAGS if getattr(args, name) is not None}
    return LMConfig(block=block, **given)


def lm_listing() -> list[dict]:
    """``--model lm --list-modes``: every ``LMBugMode.as_dict()`` in listing order."""
    return [mode.as_dict() for mode in LM_REGISTRY.values()]


def lm_result(judged: dict) -> dict:
    """``judge_lm``'s dict plus ``failed``: the measures above their bound, in ``MEASURES``
    order (empty when it passes)."""
    return {**judged, "failed": [m for m in MEASURES if judged[m] > judged["bounds"][m]]}


def lm_jobs(args: argparse.Namespace, lm: LMConfig) -> list[tuple[LMConfig, int, str]]:
    """``(LMConfig, seed, mode)`` of the run: ``--mode matrix`` every LM mode (mode-major) for
    every ``--seeds``, else ``lm_mode(--mode)`` for ``--seed`` (``ValueError`` for a seed out of
    range)."""
    if args.mode == "matrix":
        seeds = [check_seed(seed) for seed in args.seeds]
        return [(lm, seed, mode) for mode in LM_REGISTRY for seed in seeds]
    return [(lm, check_seed(args.seed), lm_mode(args.mode))]


def run_lm(seed: int, mode: str, lm: LMConfig, lr: float = LR) -> dict:
    """One LM run on simulated ranks: ``lm_result`` of ``mode``'s step against the dense LM."""
    lm, prog, clip = lm_case(mode, lm)
    tp = gather_lm_step(simulated_lm_job(lm, seed, lr, prog), lm)
    return lm_result(judge_lm(seed, mode, lm, dense_lm_job(lm, seed, lr, clip), tp, lr))


def run_lm_jobs(jobs, lr: float = LR) -> list[dict]:
    """``run_lm`` of every ``(LMConfig, seed, mode)`` of ``jobs``."""
    return [run_lm(seed, mode, lm, lr) for lm, seed, mode in jobs]


def lm_diagnosis(seed: int, mode: str, lm: LMConfig) -> list[dict]:
    """``--diagnose``: the tier-1 observables (``lm_observe.lm_tier1``) of ``mode``'s run."""
    from tpattn.diagnosis.lm_observe import lm_tier1, observe_lm

    return lm_tier1(observe_lm(mode, seed, lm))


def lm_main(args: argparse.Namespace, block) -> list[dict] | dict:
    """``--model lm``'s JSON on simulated ranks: a list for ``--mode matrix``, else one dict,
    each with ``diagnosis`` under ``--diagnose`` (``ValueError`` for bad input)."""
    check_lm_args(args)
    jobs = lm_jobs(args, lm_config(args, block))
    results = run_lm_jobs(jobs)
    if args.diagnose:
        for result, (lm, seed, mode) in zip(results, jobs):
            result["diagnosis"] = lm_diagnosis(seed, mode, lm)
    return results if args.mode == "matrix" else results[0]

