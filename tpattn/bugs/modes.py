"""The front door: a mode is resolved once, here, to its registry entry, then checked.

``run(seed, mode, cfg)`` accepts every mode of the bug registry (``python -m tpattn
--list-modes``): ``resolve`` looks the name up in ``tpattn.bugs.zoo.REGISTRY`` once, and the
entry's ``Injection`` is the whole sharded program ``tpattn.check.core.check_injection``
runs. Below this module nothing compares mode names.
"""
from __future__ import annotations

from tpattn.block.params import shard_params
from tpattn.check.core import (ALL_MODES, EQUIVALENCE, MODES, SEEDS, check_injection, check_seed,
                               check_simulate)
from tpattn.check.tolerance import check_tolerance
from tpattn.config import Config

from .zoo import REGISTRY, BugMode, check_mode, check_needs, modes_for

__all__ = ["check_mode", "modes_for", "resolve", "resolve_all", "run",
           "run_matrix"]


def resolve(mode: str, cfg: Config | None = None) -> BugMode:
    """The registry entry of ``mode``, looked up and checked once: one of the original
    fixture's check's modes must apply to ``cfg`` (``check_mode``), any other runnable mode
    must meet its needs on ``cfg`` (``zoo.check_needs``; no ``cfg``: the name only). A name
    the registry does not hold raises ``ValueError`` naming ``modes_for(cfg)`` and
    ``--list-modes``."""
    entry = REGISTRY.get(mode) if isinstance(mode, str) else None
    if entry is None:
        raise ValueError(f"mode must be one of {', '.join(modes_for(cfg))} or a registry mode "
                         f"(python -m tpattn --list-modes) (got {mode!r})")
    if mode in ALL_MODES:
        check_mode(mode, cfg)
    elif cfg is not None and entry.injection is not None:
        check_needs(mode, cfg)
    return entry


def resolve_all(modes, cfg: Config | None = None) -> list[BugMode]:
    """``resolve`` of every name of ``modes``, in order: the programs (``.name``,
    ``.injection``) the check's helpers take (``check.stack``, ``check.kv_steps``,
    ``check.at_scale``)."""
    return [resolve(m, cfg) for m in modes]


def run(seed: int = 11, mode: str = EQUIVALENCE, cfg: Config | None = None,
        simulate: str = "fixture", shard_fn=shard_params, tolerance: str = "seed",
        init: str = "seed") -> dict:
    """Dense vs TP on the five measures for any mode of the registry: ``resolve`` it once,
    then ``check.core.check_injection`` of its injection (its arguments and result).

    ``shard_fn`` replaces the injection's cut (default ``shard_params``: the cut each mode's
    injection describes). ``tolerance="auto"`` and ``init="fan_in"`` cover the original
    fixture's check's modes (``ALL_MODES``); any other mode takes only ``"seed"``."""
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
    inj = resolve(mode, cfg).injection
    if inj is None:
        check_needs(mode, cfg)  # raises: the mode has no injection of this block
    return check_injection(seed, mode, inj, cfg, simulate,
                           None if shard_fn is shard_params else shard_fn, tolerance, init)


def run_matrix(seeds=SEEDS, modes=MODES, cfg: Config | None = None,
               simulate: str = "fixture", tolerance: str = "seed",
               init: str = "seed") -> list[dict]:
    """``run`` for every mode × seed, mode-major (all seeds of the first mode first), as the
    original fixture does."""
    cfg = Config() if cfg is None else cfg
    modes = [resolve(m, cfg).name for m in modes]
    seeds = [check_seed(s) for s in seeds]
    check_simulate(simulate)
    check_tolerance(tolerance)
    return [run(s, m, cfg, simulate, tolerance=tolerance, init=init) for m in modes for s in seeds]
