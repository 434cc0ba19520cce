"""Chapter 12's explorer: ``seed_mode_explorer`` on simulated ranks with ``SP_MODES`` and a
``sequence_parallel`` config, live and static."""
from __future__ import annotations

from ..check import EQUIVALENCE, SP_MODES
from ..config import Config
from .core import Explorer
from .explorers import seed_mode_explorer

__all__ = ["SP_EXPLORER_CONFIG", "sp_explorer"]

#: The chapter's block: the seed's shapes with 8 tokens, so that 2 ranks hold 4 each.
SP_EXPLORER_CONFIG = Config(seq=8, sequence_parallel=True)


def sp_explorer(seed: int = 11, mode: str = EQUIVALENCE, cfg: Config | None = None) -> Explorer:
    """Seed × SP mode on simulated ranks: the five measures, the verdict, the bars
    (``seed_mode_explorer`` with ``simulate="ranks"`` and ``SP_MODES``)."""
    cfg = SP_EXPLORER_CONFIG if cfg is None else cfg
    if not cfg.sequence_parallel:
        raise ValueError("cfg must have sequence_parallel=True (the explorer runs the SP block)")
    return seed_mode_explorer(seed, mode, cfg, simulate="ranks", modes=SP_MODES,
                              name="seed × SP mode", kind="sp-seed-mode")
