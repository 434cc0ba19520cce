"""The decoder LM's five measures judged as the block's under ``tolerance="auto"``: the same
bounds (``tolerance.per_parameter``, ``apply_auto``) with the LM's fan-in and depth."""
from __future__ import annotations

import math

from tpattn.model.config import LMConfig
from .measures import five_measures
from .tolerance import (ACCUMULATOR, LATER_STAGES, SAFETY, UNIT_ROUNDOFF, apply_auto,
                        check_kernel_precision, fan_in, per_parameter)

__all__ = ["SUBLAYERS", "lm_fan_in", "lm_depth", "lm_bound_terms", "judge_lm"]

#: Sublayers per layer whose output the residual stream adds up: attention, then the MLP.
SUBLAYERS = 2


def lm_fan_in(lm: LMConfig) -> int:
    """``n``: the longest dot product of the LM's step: the block's ``fan_in``, ``ffn`` (the
    down projection, gate/up's input gradient), ``vocab`` (head's input gradient, softmax sum)."""
    return max(fan_in(lm.block), lm.ffn, lm.vocab)


def lm_depth(lm: LMConfig) -> int:
    """Stages that each add one block's rounding difference: ``SUBLAYERS`` per layer, plus
    the final norm, head and cross-entropy as one."""
    return SUBLAYERS * lm.layers + 1


def lm_bound_terms(lm: LMConfig) -> tuple[float, float]:
    """``tolerance.bound_terms`` with ``n = lm_fan_in``, each times ``lm_depth``: to first
    order the stages' relative rounding differences add along the residual stream."""
    cfg, depth = lm.block, lm_depth(lm)
    u, u_acc = UNIT_ROUNDOFF[cfg.dtype], UNIT_ROUNDOFF[ACCUMULATOR[cfg.dtype]]
    return (depth * SAFETY * u_acc * math.sqrt(lm_fan_in(lm)),
            depth * SAFETY * u * (cfg.world_size + LATER_STAGES))


def judge_lm(seed: int, mode: str, lm: LMConfig, dense: dict, tp: dict, lr: float) -> dict:
    """``five_measures`` of ``dense_lm_step``'s dict against ``gather_lm_step``'s, judged by
    ``apply_auto`` on ``per_parameter``'s bounds from ``lm_bound_terms``: ``verdict``,
    ``bounds``, ``worst_parameter``, ``passed``."""
    check_kernel_precision(lm.block)
    metrics = five_measures(seed, mode, dense, tp)
    metrics, bounds = per_parameter(lm.block, metrics, dense, tp, lr, lm_bound_terms(lm))
    return apply_auto(metrics, bounds)
