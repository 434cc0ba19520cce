"""The front door: ``resolve`` turns a mode name into its registry entry once; ``run`` checks
the entry's ``Injection`` (``check.core.check_injection``). Below this, no mode names."""
from __future__ import annotations

from tpattn.block.params import shard_params
from tpattn.check.core import (ALL_MODES, EQUIVALENCE, MODES, SEEDS, check_injection, check_seed,
                               check_simulate)
from tpattn.check.tolerance import check_tolerance
from tpattn.config import Config

from .zoo import REGISTRY, BugMode, modes_for, resolve

__all__ = ["modes_for", "resolve", "resolve_all", "run", "run_matrix"]


def resolve_all(modes, cfg: Config | None = None) -> list[BugMode]:
    """``resolve`` of every name of ``modes``, in order."""
    return [resolve(m, cfg) for m in modes]


def run(seed: int = 11, mode: str = EQUIVALENCE, cfg: Config | None = None,
        simulate: str = "fixture", shard_fn=shard_params, tolerance: str = "seed",
        init: str = "seed") -> dict:
    """Dense vs TP on the five measures for any registry mode (``check_injection``); ``shard_fn``
    replaces the injection's cut; ``tolerance="auto"``, ``init="fan_in"``: ``ALL_MODES`` only."""
    check_tolerance(tolerance)
    cfg = Config() if cfg is None else cfg
    if isinstance(mode, str) and mode in REGISTRY and mode not in ALL_MODES:
        if tolerance != "seed":
            covered = [n for n in REGISTRY if n in ALL_MODES]
            raise ValueError(f"tolerance must be 'seed' for a bug-registry mode such as {mode} "
                             f"(the auto bound covers {', '.join(covered)})")
        if init != "seed":
            raise ValueError(f"init must be 'seed' for a bug-registry mode such as {mode} "
                             f"(got {init!r})")
        check_seed(seed)
        check_simulate(simulate)
    inj = resolve(mode, cfg, strict=mode not in ALL_MODES).injection
    return check_injection(seed, mode, inj, cfg, simulate,
                           None if shard_fn is shard_params else shard_fn, tolerance, init)


def run_matrix(seeds=SEEDS, modes=MODES, cfg: Config | None = None,
               simulate: str = "fixture", tolerance: str = "seed",
               init: str = "seed") -> list[dict]:
    """``run`` for every mode × seed, mode-major, as the original fixture does."""
    cfg = Config() if cfg is None else cfg
    modes = [resolve(m, cfg).name for m in modes]
    seeds = [check_seed(s) for s in seeds]
    check_simulate(simulate)
    check_tolerance(tolerance)
    return [run(s, m, cfg, simulate, tolerance=tolerance, init=init) for m in modes for s in seeds]
