r"""How different may correct TP be from dense? A bound per measure, from the computation.

The original fixture's check uses one absolute threshold, ``check.TOLERANCE = 1e-6``:
float32 rounding at its toy size (fan-in 16) is ~1e-7. At the Llama-3-8B attention shape (hidden 4096, 32/8
heads of 128) correct float32 TP differs from dense by ~1e-6 in the forward, and in bfloat16
by ~3e-2: a fixed threshold is either too tight (fails correct TP) or blind (passes bugs).
``tolerance="auto"`` replaces it by a bound for each measure ``m``::

    bound_m = rho * scale_m
    rho     = C * (u_acc * sqrt(n) + u * (W + L))

(for a parameter gradient, the ``u_acc sqrt(n)`` term is taken of the summands' magnitude;
see ``scale_m`` below).

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
  ``max |y|`` (forward), ``|loss|``, ``max |dL/dx|``, and for the gradients *each
  parameter's own* scale (``parameter_bounds``): one scale for all parameters would measure
  a bug confined to a parameter with small gradients against the largest one's. For the
  gradients the long sums' term takes Higham and Mary's scale, the *summands'* magnitude
  ``max M_p`` (``magnitude.gradient_magnitudes``: the backward again in absolute values,
  ``M_p >= |dL/dp|``), and only the stages' term the result's: a gradient that cancels
  keeps the rounding of its terms (``wk`` with one input channel cancels to ``1e-8`` of its
  summands, and its TP and dense values are both rounding). The two parameter measures
  report their worst parameter (``per_parameter``, ``worst_parameter``). Differences of
  two correct computations are relative to the size of the numbers, so the bound is too.
- weights after the step ``w' = w - lr * g`` (``sgd.sgd_step``): the update runs in the
  master dtype (``MASTER``: float32 master weights for bfloat16, as bfloat16 TP trains).
  Each side rounds ``lr * g`` and the difference once at the master's ``u``:
  ``2 u_master (|w'| + lr |g|)``, plus ``lr`` times the gradient bound (bfloat16's ``rho``:
  the gradient is bfloat16).
- ``C = 1``: *calibrated*, not derived. Higham and Mary's bound holds with probability
  ``>= 1 - 2 n exp(-lambda**2 / 2)`` for a ``lambda`` of a few; ``C = 1`` is ``lambda = 1``,
  for which that guarantee is empty. What backs it is measurement: correct TP over random
  shapes, world sizes 1-8, both inits and all three dtypes (``tests/check/test_tolerance.py``),
  and ``bench/tolerance_headroom.py``'s distribution (``book/data/tolerance_headroom.json``)
  under four kernel settings of one AMD EPYC (machine default, ATen default + MKL SSE4_2,
  ATen avx2 + MKL AVX2, ``MKL_CBWR=COMPATIBLE``): measure / bound <= 0.74 at the Llama shape
  (seeds 1-5, TP 2/4/8), and 0-3 of 240 held-out small-shape runs per setting above 1
  (at most 1.48), which the floor makes inconclusive. It is a bound *for a well-conditioned
  step*; the next paragraph is what happens otherwise.

Conditioning. The bound's model is "a relative rho in, a relative rho out". A step can
amplify: the original fixture's 0.15 init at hidden 4096 gives attention scores of several
hundred, a nearly one-hot softmax, and a step that turns a relative ``rho`` perturbation of its start
into ~300 ``rho`` of its gradients. Then how much rounding the CPU's kernels do decides the
verdict: on an AVX-512 Xeon such a correct TP step measured 2-19x the bound, on an AMD EPYC
0.13x. ``amplification`` measures it on the machine and kernels that run the check: one more
dense step from a start moved by a relative ``rho`` (``perturbed_start``); ``A_m`` = its
difference over ``bound_m``. A measure above its bound but within ``max(1, A_m) bound_m``
(``rounding_floors``) cannot be told from rounding: the verdict is ``"inconclusive"``, with
the reason, never ``"fail"`` (``apply_auto``). The probe runs only when a measure exceeds
its bound, so a passing run costs nothing more.

Where the bound applies: float32 matmuls at full precision, bfloat16 matmuls accumulating
in float32. ``check_kernel_precision`` refuses the settings that break that model
(``torch.set_float32_matmul_precision`` below "highest"; on CUDA, TF32 and bfloat16
reduced-precision split-K reductions).

Bugs sit far above: a missing reduction changes a measure by a fraction ``~ (W-1)/W`` of its
own scale, i.e. by a *relative* ``O(1)``. ``bug_margin`` = ``max_m measure_m / bound_m`` is
how far a run fails. In float32/float64 (well conditioned) it is ``~1 / rho`` (10^4 .. 10^12); in bfloat16,
whose ``u`` is ``2**-8``, no rounding bound on max-abs measures can leave more than
``~1 / (u (W + L))`` (a few tens) between rounding and a bug: bfloat16's rounding is a
percent.
"""
from __future__ import annotations

import math

import torch

from tpattn.config import Config
from .measures import five_measures, max_abs_diff

#: Unit roundoff ``u`` of each Config dtype (half the distance from 1 to the next float).
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8}
#: Precision long sums (matmuls, reductions inside a kernel) accumulate in.
ACCUMULATOR = {"float64": "float64", "float32": "float32", "bfloat16": "float32"}
#: Elementwise stages after the reductions, each rounded in the stored dtype.
LATER_STAGES = 4
#: ``C``: calibrated, not derived (see the module doc and bench/tolerance_headroom.py).
SAFETY = 1.0
#: Factor on the measured amplified floor (calibrated the same way).
FLOOR_SAFETY = 1.0
#: The three verdicts of ``tolerance="auto"`` (``apply_auto``).
VERDICTS = ("pass", "inconclusive", "fail")
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


def bound_terms(cfg: Config) -> tuple[float, float]:
    """``rho``'s two terms: ``(C u_acc sqrt(n), C u (W + L))``, the long sums' and the stages'."""
    u = UNIT_ROUNDOFF[cfg.dtype]
    u_acc = UNIT_ROUNDOFF[ACCUMULATOR[cfg.dtype]]
    return (SAFETY * u_acc * math.sqrt(fan_in(cfg)),
            SAFETY * u * (cfg.world_size + LATER_STAGES))


def relative_bound(cfg: Config) -> float:
    """``rho = C (u_acc sqrt(n) + u (W + L))``: allowed difference relative to the scale."""
    return sum(bound_terms(cfg))


def _max_abs(t: torch.Tensor) -> float:
    lo, hi = torch.aminmax(t.detach())  # one pass, no |t| temporary (6x abs().max())
    return max(-lo.item(), hi.item())


def check_kernel_precision(cfg: Config, device: torch.device | str = "cpu") -> None:
    """Raise ``ValueError`` where the bound's model of the kernels does not hold.

    The bound assumes float32 matmuls that multiply and accumulate in float32 and bfloat16
    matmuls that accumulate in float32 and round once at the end. On CPU,
    ``torch.set_float32_matmul_precision("high"/"medium")`` lets float32 matmuls run in a
    lower precision; on CUDA, ``torch.backends.cuda.matmul.allow_tf32`` (TF32: ``u = 2**-11``)
    and ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` (split-K partial
    sums in bfloat16) do. Those settings are refused with the flag's name, not absorbed.
    """
    kind = torch.device(device).type
    if cfg.dtype == "float32" and torch.get_float32_matmul_precision() != "highest":
        raise ValueError(
            f"tolerance='auto' needs torch.get_float32_matmul_precision() == 'highest' "
            f"(got {torch.get_float32_matmul_precision()!r}): lower precisions round "
            f"float32 matmuls at more than float32's u")
    if kind == "cuda" and cfg.dtype == "float32" and torch.backends.cuda.matmul.allow_tf32:
        raise ValueError("tolerance='auto' needs torch.backends.cuda.matmul.allow_tf32 = False "
                         "(TF32 rounds float32 matmul inputs to u = 2**-11)")
    if kind == "cuda" and cfg.dtype == "bfloat16" \
            and torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction:
        raise ValueError(
            "tolerance='auto' needs torch.backends.cuda.matmul."
            "allow_bf16_reduced_precision_reduction = False (split-K partial sums in "
            "bfloat16 do not accumulate in float32)")


#: Precision the SGD update runs in and the weights after it are kept in (``sgd.MASTER_DTYPE``:
#: bfloat16 parameters have float32 master weights, as bfloat16 TP trains).
MASTER = {"float64": "float64", "float32": "float32", "bfloat16": "float32"}
#: The measures compared parameter by parameter (``parameter_bounds``, ``per_parameter``).
PARAMETER_MEASURES = ("parameter_grad_max_abs_diff", "post_step_weight_max_abs_diff")
_SIDE = {"parameter_grad_max_abs_diff": "grads", "post_step_weight_max_abs_diff": "weights"}


def parameter_bounds(cfg: Config, dense: dict, lr: float) -> dict[str, dict[str, float]]:
    """Each parameter's own bounds, ``{measure: {name: bound}}`` for ``PARAMETER_MEASURES``.

    Gradient of ``p``: ``C u_acc sqrt(n) max M_p + C u (W + L) max |dL/dp|``
    (``bound_terms``): the long sums' rounding against the magnitude of their summands
    (``M_p = dense["grad_magnitudes"][p]``, ``magnitude.gradient_magnitudes``; without that
    key ``|dL/dp|``), the stages' against the result. Its own scale: a bug confined to a
    parameter with small gradients, e.g. ``wq``, is measured against that parameter's size,
    not the largest gradient's. Weights after the step ``w' = w - lr g`` (``sgd.sgd_step``, in the
    master dtype ``MASTER``, float32 for bfloat16): each side rounds the product and the
    difference once at the master's ``u``, so ``2 u_master (max |w'| + lr max |g|)`` plus
    ``lr`` times the gradient's bound (the gradient is the dtype's, bfloat16's ``rho``)."""
    sums, stages = bound_terms(cfg)
    g_max = {k: _max_abs(g) for k, g in dense["grads"].items()}
    m_max = {k: _max_abs(m) for k, m in dense.get("grad_magnitudes", dense["grads"]).items()}
    grad = {k: sums * m_max[k] + stages * g for k, g in g_max.items()}
    return {"parameter_grad_max_abs_diff": grad,
            "post_step_weight_max_abs_diff": {
                k: _weight_bound(cfg, dense, lr, k, grad[k], g) for k, g in g_max.items()}}


def _weight_bound(cfg: Config, dense: dict, lr: float, name: str, grad_bound: float,
                  g_max: float | None = None) -> float:
    u = UNIT_ROUNDOFF[MASTER[cfg.dtype]]
    g_max = _max_abs(dense["grads"][name]) if g_max is None else g_max
    return 2 * u * (_max_abs(dense["weights"][name]) + lr * g_max) + lr * grad_bound


def auto_bounds(cfg: Config, dense: dict, lr: float, worst: dict | None = None) -> dict:
    """One bound per measure (``check.MEASURES`` order) from the dense side's ``one_step``
    tensors: ``output`` ``[S, B, hidden]``, ``loss``, ``input_grad``, ``grads``, ``weights``.

    The two ``PARAMETER_MEASURES`` are bounded per parameter (``parameter_bounds``): here the
    bound of parameter ``worst[m]`` (``per_parameter`` names it), or without ``worst`` the
    largest over the parameters."""
    return _bounds(cfg, dense, parameter_bounds(cfg, dense, lr), worst or {})


def _bounds(cfg: Config, dense: dict, by_name: dict, worst: dict) -> dict:
    rho = relative_bound(cfg)
    return {
        "forward_max_abs_diff": rho * _max_abs(dense["output"]),
        "loss_abs_diff": rho * _max_abs(dense["loss"]),
        "input_grad_max_abs_diff": rho * _max_abs(dense["input_grad"]),
        **{m: (by_name[m][worst[m]] if m in worst else max(by_name[m].values()))
           for m in PARAMETER_MEASURES},
    }


def per_parameter(cfg: Config, metrics: dict, dense: dict, tp: dict,
                  lr: float) -> tuple[dict, dict]:
    """``(metrics, bounds)`` for ``apply_auto`` with every parameter against its own bound.

    ``metrics``: ``check.five_measures(seed, mode, dense, tp)``; ``dense``, ``tp``: the two
    sides' ``one_step`` dicts. For each of ``PARAMETER_MEASURES`` the worst parameter is the
    one with the largest ``|dense - tp|_p / bound_p``; the measure becomes that parameter's
    max-abs difference, its bound that parameter's bound, and ``worst_parameter`` (added)
    names it per measure. So ``measure <= bound`` holds iff it holds for every parameter."""

    by_name = parameter_bounds(cfg, dense, lr)
    out, worst = dict(metrics), {}
    for m in PARAMETER_MEASURES:
        side = _SIDE[m]
        diffs = {k: max_abs_diff(dense[side][k], tp[side][k]) for k in by_name[m]}
        worst[m] = max(diffs, key=lambda k: _ratio(diffs[k], by_name[m][k]))
        out[m] = diffs[worst[m]]
    out["worst_parameter"] = worst
    return out, _bounds(cfg, dense, by_name, worst)


def _ratio(measure: float, bound: float) -> float:
    return measure / bound if bound else 0.0 if measure == 0 else math.inf


def perturb(t: torch.Tensor, rel: float) -> torch.Tensor:
    """``t * (1 + rel * s)`` elementwise, same shape and dtype, with signs ``s = +-1`` taken
    from the parity of each element's lowest significand bit (pseudo-random for drawn data,
    deterministic, no RNG touched). Computed in float64 then rounded to ``t``'s dtype."""
    bits = t.detach().contiguous().view({torch.float64: torch.int64, torch.float32: torch.int32,
                                         torch.bfloat16: torch.int16}[t.dtype])
    sign = (bits & 1).double() * 2 - 1
    return (t.detach().double() * (1 + rel * sign)).to(t.dtype)


def perturbed_start(cfg: Config, x0: torch.Tensor, base: dict[str, torch.Tensor]):
    """The conditioning probe's start: ``x0`` ``[S, B, hidden]`` and every parameter of
    ``base`` perturbed by a relative ``relative_bound(cfg)`` (``perturb``); the target and the
    norm weight's ones included. Returns ``(x, params)``."""
    rho = relative_bound(cfg)
    return perturb(x0, rho), {k: perturb(v, rho) for k, v in base.items()}


def amplification(cfg: Config, dense: dict, probe: dict,
                  by_name: dict[str, float] | None = None) -> dict[str, float]:
    """How much the step amplifies a relative perturbation of its start, per measure.

    ``probe`` is the dense step again from ``perturbed_start`` (every input and parameter moved
    by a relative ``rho = relative_bound(cfg)``): ``A_m = |probe - dense|_m / (rho scale_m)``,
    for the gradients the largest over the parameters, each against its own scale. A
    well-conditioned step has ``A_m <= ~1`` (a relative ``rho`` in, a relative ``rho`` out:
    the bound's model). A saturated softmax (the original fixture's 0.15 init at hidden 4096: scores of
    several hundred) has ``A`` in the hundreds: any rounding inside the step -- the kernels',
    the TP side's -- comes out that much larger, and how much rounding a CPU's kernels do
    decides whether correct TP passes. The weights' measure has no ``A`` of its own (the probe
    moves the weights themselves); its floor follows the gradients' (``rounding_floors``).
    ``by_name``: ``parameter_amplification``'s result when the caller has it already.
    """

    diff = five_measures(0, "probe", dense, probe)
    scales = auto_bounds(cfg, dense, 0.0)
    amp = {m: _ratio(diff[m], scales[m]) if scales[m] else 0.0
           for m in ("forward_max_abs_diff", "loss_abs_diff", "input_grad_max_abs_diff")}
    by_name = parameter_amplification(cfg, dense, probe) if by_name is None else by_name
    amp["parameter_grad_max_abs_diff"] = max(by_name.values())
    return amp


def parameter_amplification(cfg: Config, dense: dict, probe: dict) -> dict[str, float]:
    """``A_p`` of each parameter's gradient, by name: ``|probe - dense|`` of that gradient
    over its own bound (``parameter_bounds``); ``amplification`` reports the largest."""

    grad = parameter_bounds(cfg, dense, 0.0)["parameter_grad_max_abs_diff"]
    return {k: (max_abs_diff(dense["grads"][k], probe["grads"][k]) / b if b else 0.0)
            for k, b in grad.items()}


def rounding_floors(cfg: Config, dense: dict, amp: dict[str, float], lr: float,
                    worst: dict | None = None, by_name: dict[str, float] | None = None) -> dict:
    """What rounding can reach once amplified: ``max(1, A_m) * bound_m`` per measure
    (``FLOOR_SAFETY`` times that), and for the weights ``2 u (|w'| + lr |g|) + lr *
    floor_grad`` (``parameter_bounds``); the parameter measures' floors are those of the
    parameters ``worst`` names (``per_parameter``), else the largest over the parameters.
    ``by_name``: each parameter's own ``A_p`` (``parameter_amplification``) for its floors;
    without it every parameter takes the largest, ``amp["parameter_grad_max_abs_diff"]``."""
    bounds = auto_bounds(cfg, dense, lr, worst)
    floors = {m: FLOOR_SAFETY * max(1.0, a) * bounds[m] for m, a in amp.items()}
    grad = parameter_bounds(cfg, dense, lr)["parameter_grad_max_abs_diff"]

    def g_amp(k):
        a = amp["parameter_grad_max_abs_diff"] if by_name is None else by_name[k]
        return FLOOR_SAFETY * max(1.0, a)
    if worst and by_name is not None:
        k = worst["parameter_grad_max_abs_diff"]
        floors["parameter_grad_max_abs_diff"] = g_amp(k) * grad[k]
    names = [worst["post_step_weight_max_abs_diff"]] if worst else list(grad)
    floors["post_step_weight_max_abs_diff"] = max(
        _weight_bound(cfg, dense, lr, k, g_amp(k) * grad[k]) for k in names)
    return floors


def ratios(metrics: dict, bounds: dict) -> dict[str, float]:
    """``measure / bound`` for each measure: < 1 passes; a bug's largest ratio is its margin."""
    return {m: _ratio(metrics[m], bounds[m]) for m in bounds}


def bug_margin(metrics: dict, bounds: dict) -> float:
    """How far a run fails: ``max_m measure_m / bound_m`` (a passing run has this < 1)."""
    return max(ratios(metrics, bounds).values())


def conditioning(cfg: Config, dense: dict, probe: dict, lr: float,
                 worst: dict | None = None) -> tuple[dict, dict]:
    """``(floors, amp)``: ``rounding_floors`` (for the parameters ``worst`` names, each with
    its own ``parameter_amplification``) and ``amplification`` from the dense step ``dense`` and its probe ``probe`` (the dense step
    from ``perturbed_start``)."""
    by_name = parameter_amplification(cfg, dense, probe)
    amp = amplification(cfg, dense, probe, by_name)
    return rounding_floors(cfg, dense, amp, lr, worst, by_name), amp


def apply_auto(metrics: dict, bounds: dict, floors=None) -> dict:
    """``run()``'s dict under ``tolerance="auto"``: the measures, then ``tolerance``,
    ``bounds`` (by measure), ``verdict`` and ``passed`` (``verdict == "pass"``).

    ``verdict``: ``"pass"`` when every measure is at most its bound. Otherwise the step's
    conditioning decides. ``floors``: ``conditioning``'s ``(floors, amp)``, or a function
    returning it (called only here: a passing run pays nothing for the probe).
    ``"inconclusive"`` when every measure is within its floor (rounding, amplified up to
    ``max(amp)`` times, reaches as far as the difference: this machine cannot tell rounding
    from a bug; ``reason`` says so and what to do), ``"fail"`` when one exceeds it; with
    ``floors=None``, ``"fail"``. When used, ``floors`` and ``amplification`` (the largest
    ``A_m``) are added.
    """
    out = {k: v for k, v in metrics.items() if k != "passed"}
    out["tolerance"] = "auto"
    out["bounds"] = dict(bounds)
    if all(metrics[m] <= bounds[m] for m in bounds):
        out["verdict"] = "pass"
    elif floors is None:
        out["verdict"] = "fail"
    else:
        floors, amp = floors() if callable(floors) else floors
        worst = max(amp.values())
        out["floors"] = dict(floors)
        out["amplification"] = worst
        if all(metrics[m] <= floors[m] for m in bounds):
            out["verdict"] = "inconclusive"
            out["reason"] = (f"rounding is amplified ~{worst:.0f}x here (ill-conditioned "
                             f"step): every difference is within what amplified rounding "
                             f"reaches; re-run with init=fan_in or in float64")
        else:
            out["verdict"] = "fail"
    out["passed"] = out["verdict"] == "pass"
    return out
