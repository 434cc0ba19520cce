"""Rounding or a bug, at step N, for every LM mode: ``mode_curves`` trains a mode (its case from
``lm_case``) against its dense run and the rounding envelope
(``tpattn.model.envelope``), remembered per case, with the margin and K chosen on the tuned
cases of ``bench/lm_envelope.py``."""
from __future__ import annotations

import functools
from dataclasses import replace

from tpattn.config import Config
from tpattn.model.config import LMConfig
from tpattn.model.envelope import judge_curves, make_batches, reference_curves, replayed
from tpattn.model.params import init_lm_params
from tpattn.model.tp import LMProgram
from .lm_zoo import LM_EQUIVALENCE, LM_REGISTRY, lm_case

__all__ = ["CURVE_LR", "K", "MARGIN", "CURVE_LM", "CURVE_STEPS",
           "training_modes", "reference_for", "mode_curves"]

#: SGD learning rate of the curves.
CURVE_LR = 0.1
#: Dense twins one rounding away per envelope.
K = 3
#: A run leaves the envelope where its divergence exceeds MARGIN x the envelope (correct TP
#: reached 1.85 x on the tuned cases).
MARGIN = 4.0
#: The chapter's and the explorer's LM: the default shape on 2 ranks.
CURVE_LM = LMConfig(block=Config(world_size=2))
#: The chapter's number of SGD steps.
CURVE_STEPS = 20


def training_modes() -> list[str]:
    """Every LM mode whose program changes training: all but the correct one, in order."""
    return [m for m in LM_REGISTRY if m != LM_EQUIVALENCE]


def reference_for(lm: LMConfig, clip: bool, seed: int, steps: int) -> tuple:
    """``(dense, envelope)`` of ``lm`` (any world size: the dense run has none), clipped if
    ``clip``, from ``seed``'s parameters and ``steps`` token batches; computed once per case
    (remembered: never modify them)."""
    return _reference(replace(lm, block=replace(lm.block, world_size=1)), clip, seed, steps)


@functools.lru_cache(maxsize=64)
def _reference(lm: LMConfig, clip: bool, seed: int, steps: int) -> tuple:
    return reference_curves(lm, clip, init_lm_params(lm, seed), make_batches(lm, seed, steps),
                            CURVE_LR, K, seed)


def mode_curves(mode: str, seed: int, steps: int, dtype: str = "float32",
                lm: LMConfig = CURVE_LM) -> dict:
    """``mode`` trained for ``steps`` SGD steps from ``seed``'s parameters and token batches
    in ``dtype``, judged against its dense run and envelope (``judge_curves``' dict, plus
    ``mode``); in bfloat16 completed by the float32 replay of the same steps (``replayed``:
    a systematic error below bfloat16's rounding shows there). Computed once per argument
    list, the dense run and envelope once per case (remembered: never modify them)."""
    return _mode_curves(mode, seed, steps, dtype, lm)


@functools.lru_cache(maxsize=256)
def _mode_curves(mode: str, seed: int, steps: int, dtype: str, lm: LMConfig) -> dict:
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16' (got {dtype!r})")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0 (got {seed!r})")
    base, lm = lm, replace(lm, block=replace(lm.block, dtype=dtype))
    lm, prog, _ = lm_case(mode, lm)
    params, batches = init_lm_params(lm, seed), make_batches(lm, seed, steps)
    reference = reference_for(lm, prog.clip, seed, steps)
    out = judge_curves(lm, prog, params, batches, CURVE_LR, K, MARGIN, seed, reference)
    if dtype != "float32":
        out = {**out, **replayed(out, mode_curves(mode, seed, steps, "float32", base))}
    return {"mode": mode, **out}
