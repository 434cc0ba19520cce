"""The front door: a mode is resolved once, here, then runs where it lives.

``run(seed, mode, cfg)`` accepts every mode of the bug registry (``python -m tpattn
--list-modes``): the package's own (``check.core.NATIVE_MODES``: the seed's three, sequence
parallelism's, fewer KV heads') run in ``tpattn.check.core.run_native``; the others are
injections of the zoo's block (``tpattn.bugs.zoo.run``).
"""
from __future__ import annotations

from tpattn.block.params import shard_params
from tpattn.check.core import (EQUIVALENCE, MODES, NATIVE_MODES, SEEDS, check_mode, check_seed,
                               check_simulate, modes_for, run_native)
from tpattn.check.tolerance import check_tolerance
from tpattn.config import Config

from .zoo import REGISTRY
from .zoo import run as run_registry_mode

__all__ = ["check_any_mode", "mode_route", "run", "run_matrix"]


def check_any_mode(mode: str, cfg: Config | None = None) -> str:
    """Return ``mode`` if ``run`` can run it for ``cfg``: one of ``modes_for(cfg)`` (checked by
    ``check_mode``) or a mode of the bug registry (``tpattn.bugs.zoo.REGISTRY``, ``python -m tpattn
    --list-modes``); else raise ``ValueError``."""
    if mode in NATIVE_MODES:
        return check_mode(mode, cfg)
    if isinstance(mode, str) and mode in REGISTRY:
        return mode
    raise ValueError(f"mode must be one of {', '.join(modes_for(cfg))} or a registry mode "
                     f"(python -m tpattn --list-modes) (got {mode!r})")


def mode_route(mode: str, cfg: Config | None = None) -> str:
    """Where ``mode`` runs, once ``check_any_mode`` has accepted it for ``cfg`` (else its
    ``ValueError``): ``"native"`` for ``NATIVE_MODES``, computed by ``run_native`` (on real
    ranks by ``tpattn.real.ranks``), ``"registry"`` for the other modes of the bug registry,
    run by ``tpattn.bugs.zoo`` (on real ranks by ``tpattn.real.zoo_real``)."""
    return "native" if check_any_mode(mode, cfg) in NATIVE_MODES else "registry"


def run(seed: int = 11, mode: str = EQUIVALENCE, cfg: Config | None = None,
        simulate: str = "fixture", shard_fn=shard_params, tolerance: str = "seed",
        init: str = "seed") -> dict:
    """Dense vs TP on the five measures for any mode (``check.core.run_native``'s arguments
    and result; a registry mode takes only ``tolerance="seed"`` and ``init="seed"``)."""
    check_tolerance(tolerance)
    cfg = Config() if cfg is None else cfg
    if mode_route(mode, cfg) == "registry":
        if tolerance != "seed":
            raise ValueError(f"tolerance must be 'seed' for a bug-registry mode such as {mode} "
                             f"(the auto bound covers {', '.join(NATIVE_MODES)})")
        if init != "seed":
            raise ValueError(f"init must be 'seed' for a bug-registry mode such as {mode} "
                             f"(got {init!r})")
        return run_registry_mode(seed, mode, cfg, simulate)
    return run_native(seed, mode, cfg, simulate, shard_fn, tolerance, init)


def run_matrix(seeds=SEEDS, modes=MODES, cfg: Config | None = None,
               simulate: str = "fixture", tolerance: str = "seed",
               init: str = "seed") -> list[dict]:
    """``run`` for every mode × seed, mode-major (all seeds of the first mode first), as the seed."""
    cfg = Config() if cfg is None else cfg
    modes = [check_any_mode(m, cfg) for m in modes]
    seeds = [check_seed(s) for s in seeds]
    check_simulate(simulate)
    check_tolerance(tolerance)
    return [run(s, m, cfg, simulate, tolerance=tolerance, init=init) for m in modes for s in seeds]
