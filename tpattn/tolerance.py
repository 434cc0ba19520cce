r"""How different may correct TP be from dense? A bound per measure, from the computation.

The seed's check uses one absolute threshold, ``check.TOLERANCE = 1e-6``: float32 rounding at
its toy size (fan-in 16) is ~1e-7. At the Llama-3-8B attention shape (hidden 4096, 32/8
heads of 128) correct float32 TP differs from dense by ~1e-6 in the forward, and in bfloat16
by ~3e-2: a fixed threshold is either too tight (fails correct TP) or blind (passes bugs).
``tolerance="auto"`` replaces it by a bound for each measure ``m``::

    bound_m = rho * scale_m
    rho     = C * (u_acc * sqrt(n) + u * (W + L))

- ``u`` = unit roundoff of the dtype (``2**-53`` float64, ``2**-24`` float32, ``2**-8``
  bfloat16): every stored result is within a relative ``u`` of the exact one.
- ``u_acc`` = unit roundoff of the *accumulator* of a long sum. float32/float64 sum in their
  own precision; bfloat16 matmuls accumulate in float32 on CPU (oneDNN) and on GPUs, and
  round once at the end — so their ``sqrt(n)`` term is float32's.
- ``n`` = the longest dot product in the step (``fan_in``): ``hidden`` (Q/K/V projections),
  ``(Hq + 2 Hkv) * D`` (the input gradient's sum over all projections' rows), ``S * B``
  (every weight gradient sums over tokens). Rounding errors of a length-``n`` sum behave like
  a random walk: with probability near 1 they stay below ``lambda * sqrt(n) * u`` times the
  sum of the magnitudes (N. Higham and T. Mary, "A New Approach to Probabilistic Rounding
  Error Analysis", https://nla-group.org/2018/11/22/a-new-approach-to-probabilistic-rounding-error-analysis/),
  while the worst case ``gamma_n = n u / (1 -
  n u)`` is reached only by adversarial data — ``sqrt(n)`` is what a check at size needs.
- ``W + L``: results rounded once per stage in the stored dtype — the ``W - 1`` additions of
  the ranks' partials (g, and f's input-gradient sum) plus ``L = 4`` later elementwise
  stages (residual add, loss and its gradient, the SGD update). In float32 this is small
  next to ``sqrt(n)``; in bfloat16 it is the whole bound.
- ``scale_m`` = the magnitude of what the measure compares, taken from the dense side:
  ``max |y|`` (forward), ``|loss|``, ``max |dL/dx|``, the largest ``max |dL/dp|`` over the
  parameters. Differences of two correct computations are relative to the size of the
  numbers, so the bound is too.
- weights after the step ``w' = w - lr * g``: the two sides' ``w'`` can round to neighbouring
  floats (one ulp, ``<= 2 u |w'|``) plus ``lr`` times the gradient bound.
- ``C = 1``: an empirical constant, *tested*, not derived: ``tests/test_tolerance.py`` runs
  correct TP and both bugs over random shapes, world sizes and all three dtypes, and
  ``bench/tolerance_sweep.py`` at the Llama shape. Observed correct-TP differences are 4-9
  ``u`` (float32) and at most ~4 ``u`` (bfloat16) in units of ``scale_m``.

The bound does not depend on the softmax's saturation: the seed's 0.15 init at hidden 4096
gives scores of several hundred (the softmax is nearly one-hot) and the relative differences
stay in the same 4-9 ``u`` (a saturated softmax is *less* sensitive to its input, except at
near-ties).

Bugs sit far above: a missing reduction changes a measure by a fraction ``~ (W-1)/W`` of its
own scale, i.e. by a *relative* ``O(1)``. ``bug_margin`` = ``max_m measure_m / bound_m`` is
how far a run fails. In float32/float64 it is ``~1 / rho`` (10^4 .. 10^12); in bfloat16,
whose ``u`` is ``2**-8``, no rounding bound on max-abs measures can leave more than
``~1 / (u (W + L))`` (a few tens) between rounding and a bug: bfloat16's rounding is a
percent.
"""
from __future__ import annotations

import math

import torch

from .config import Config

#: Unit roundoff ``u`` of each Config dtype (half the distance from 1 to the next float).
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8}
#: Precision long sums (matmuls, reductions inside a kernel) accumulate in.
ACCUMULATOR = {"float64": "float64", "float32": "float32", "bfloat16": "float32"}
#: Elementwise stages after the reductions, each rounded in the stored dtype.
LATER_STAGES = 4
#: The empirical constant ``C`` (tested in tests/test_tolerance.py).
SAFETY = 1.0
#: The two names ``run(tolerance=...)`` accepts.
TOLERANCES = ("seed", "auto")


def check_tolerance(tolerance: str) -> str:
    """Return ``tolerance`` if it is one of ``TOLERANCES``, else raise ``ValueError``."""
    if tolerance not in TOLERANCES:
        raise ValueError(f"tolerance must be one of {', '.join(TOLERANCES)} (got {tolerance!r})")
    return tolerance


def fan_in(cfg: Config) -> int:
    """Length of the longest dot product in one training step of the block (see module doc)."""
    return max(cfg.hidden, (cfg.query_heads + 2 * cfg.kv_heads) * cfg.head_dim,
               cfg.seq * cfg.batch)


def relative_bound(cfg: Config) -> float:
    """``rho = C (u_acc sqrt(n) + u (W + L))``: allowed difference relative to the scale."""
    u = UNIT_ROUNDOFF[cfg.dtype]
    u_acc = UNIT_ROUNDOFF[ACCUMULATOR[cfg.dtype]]
    return SAFETY * (u_acc * math.sqrt(fan_in(cfg)) + u * (cfg.world_size + LATER_STAGES))


def _max_abs(t: torch.Tensor) -> float:
    return t.detach().abs().max().item()


def auto_bounds(cfg: Config, dense: dict, lr: float) -> dict[str, float]:
    """One bound per measure (``check.MEASURES`` order) from the dense side's ``one_step``
    tensors: ``output`` ``[S, B, hidden]``, ``loss``, ``input_grad``, ``grads``, ``weights``."""
    rho = relative_bound(cfg)
    u = UNIT_ROUNDOFF[cfg.dtype]
    grad_bound = rho * max(_max_abs(g) for g in dense["grads"].values())
    weight_scale = max(_max_abs(w) for w in dense["weights"].values())
    return {
        "forward_max_abs_diff": rho * _max_abs(dense["output"]),
        "loss_abs_diff": rho * _max_abs(dense["loss"]),
        "input_grad_max_abs_diff": rho * _max_abs(dense["input_grad"]),
        "parameter_grad_max_abs_diff": grad_bound,
        "post_step_weight_max_abs_diff": 2 * u * weight_scale + lr * grad_bound,
    }


def ratios(metrics: dict, bounds: dict) -> dict[str, float]:
    """``measure / bound`` for each measure: < 1 passes; a bug's largest ratio is its margin."""
    return {m: (metrics[m] / bounds[m] if bounds[m] else 0.0 if metrics[m] == 0 else math.inf)
            for m in bounds}


def bug_margin(metrics: dict, bounds: dict) -> float:
    """How far a run fails: ``max_m measure_m / bound_m`` (a passing run has this < 1)."""
    return max(ratios(metrics, bounds).values())


def apply_auto(metrics: dict, bounds: dict) -> dict:
    """``run()``'s dict under ``tolerance="auto"``: the measures, then ``bounds`` (by
    measure) and ``passed`` (every measure at most its bound)."""
    out = {k: v for k, v in metrics.items() if k != "passed"}
    out["tolerance"] = "auto"
    out["bounds"] = dict(bounds)
    out["passed"] = all(metrics[m] <= bounds[m] for m in bounds)
    return out
