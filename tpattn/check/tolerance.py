r"""How far correct TP may be from dense: ``bound_m = rho * scale_m``, ``rho = C (u_acc sqrt(n)
+ u (W + L))`` (Higham and Mary's probabilistic bound), and a verdict; a measure between its
bound and its amplified floor (``amplification``) is ``"inconclusive"``."""
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
#: ``C``, calibrated: correct TP over random shapes, world sizes 1-8, both inits and three
#: dtypes stays below it (tests/check/test_tolerance.py, bench/tolerance_headroom.py).
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
    """``n``: the longest dot product of one step: ``hidden`` (Q/K/V), ``(Hq + 2 Hkv) D`` (the
    input gradient), ``S B`` (every weight gradient sums over tokens)."""
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


def check_kernel_precision(cfg: Config) -> None:
    """Raise ``ValueError`` unless float32 matmuls run at ``"highest"`` precision, as the
    bound assumes (on CUDA, TF32's u = 2**-11 and bfloat16 split-K sums would break it too)."""
    if cfg.dtype == "float32" and torch.get_float32_matmul_precision() != "highest":
        raise ValueError(
            f"tolerance='auto' needs torch.get_float32_matmul_precision() == 'highest' "
            f"(got {torch.get_float32_matmul_precision()!r}): lower precisions round "
            f"float32 matmuls at more than float32's u")


#: Precision of the SGD update and the weights after it (float32 masters for bfloat16).
MASTER = {"float64": "float64", "float32": "float32", "bfloat16": "float32"}
#: The measures compared parameter by parameter (``parameter_bounds``, ``per_parameter``).
PARAMETER_MEASURES = ("parameter_grad_max_abs_diff", "post_step_weight_max_abs_diff")
_SIDE = {"parameter_grad_max_abs_diff": "grads", "post_step_weight_max_abs_diff": "weights"}


def parameter_bounds(cfg: Config, dense: dict, lr: float,
                     terms: tuple[float, float] | None = None) -> dict[str, dict[str, float]]:
    """Each parameter's own bounds, ``{measure: {name: bound}}`` for ``PARAMETER_MEASURES``:
    gradient ``C u_acc sqrt(n) max M_p + C u (W + L) max |dL/dp|`` (``M_p``:
    ``dense["grad_magnitudes"]``, else ``|dL/dp|``; ``terms``: those two factors, default
    ``bound_terms(cfg)``); weight after ``w' = w - lr g``:
    ``2 u_master (max |w'| + lr max |g|) + lr * grad_bound``."""
    sums, stages = bound_terms(cfg) if terms is None else terms
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


def auto_bounds(cfg: Config, dense: dict, lr: float, worst: dict | None = None,
                terms: tuple[float, float] | None = None) -> dict:
    """One bound per measure from the dense ``one_step`` dict: ``rho`` (``sum(terms)``,
    default ``relative_bound(cfg)``) times its max-abs output, loss, input gradient; for
    ``PARAMETER_MEASURES`` parameter ``worst[m]``'s bound (``parameter_bounds``), or the
    largest."""
    return _bounds(cfg, dense, parameter_bounds(cfg, dense, lr, terms), worst or {}, terms)


def _bounds(cfg: Config, dense: dict, by_name: dict, worst: dict,
            terms: tuple[float, float] | None = None) -> dict:
    rho = relative_bound(cfg) if terms is None else sum(terms)
    return {
        "forward_max_abs_diff": rho * _max_abs(dense["output"]),
        "loss_abs_diff": rho * _max_abs(dense["loss"]),
        "input_grad_max_abs_diff": rho * _max_abs(dense["input_grad"]),
        **{m: (by_name[m][worst[m]] if m in worst else max(by_name[m].values()))
           for m in PARAMETER_MEASURES},
    }


#: Relative gap under which two parameters' measure/bound ratios are the same fact (a bug that
#: scales every layer's gradient alike gives ratios equal up to rounding).
TIE = 1e-3


def per_parameter(cfg: Config, metrics: dict, dense: dict, tp: dict, lr: float,
                  terms: tuple[float, float] | None = None) -> tuple[dict, dict]:
    """``(metrics, bounds)`` for ``apply_auto``, ``PARAMETER_MEASURES`` for the worst parameter
    (largest ``|dense - tp|_p / bound_p``; ratios within ``TIE`` of it tie, and the larger
    difference wins, so every kernel names the same one; named in ``worst_parameter``);
    ``terms`` as in ``parameter_bounds``."""
    by_name = parameter_bounds(cfg, dense, lr, terms)
    out, worst = dict(metrics), {}
    for m in PARAMETER_MEASURES:
        side = _SIDE[m]
        diffs = {k: max_abs_diff(dense[side][k], tp[side][k]) for k in by_name[m]}
        ratios = {k: _ratio(diffs[k], by_name[m][k]) for k in diffs}
        top = max(ratios.values())
        worst[m] = max((k for k in diffs if ratios[k] >= top * (1 - TIE)), key=diffs.get)
        out[m] = diffs[worst[m]]
    out["worst_parameter"] = worst
    return out, _bounds(cfg, dense, by_name, worst, terms)


def _ratio(measure: float, bound: float) -> float:
    return measure / bound if bound else 0.0 if measure == 0 else math.inf


def perturb(t: torch.Tensor, rel: float) -> torch.Tensor:
    """``t * (1 + rel * s)`` in float64, rounded to ``t``'s dtype; ``s = +-1`` from each
    element's lowest significand bit (no RNG)."""
    bits = t.detach().contiguous().view({torch.float64: torch.int64, torch.float32: torch.int32,
                                         torch.bfloat16: torch.int16}[t.dtype])
    sign = (bits & 1).double() * 2 - 1
    return (t.detach().double() * (1 + rel * sign)).to(t.dtype)


def perturbed_start(cfg: Config, x0: torch.Tensor, base: dict[str, torch.Tensor]):
    """``(x, params)``: ``x0`` ``[S, B, hidden]`` and ``base`` moved by a relative ``rho``."""
    rho = relative_bound(cfg)
    return perturb(x0, rho), {k: perturb(v, rho) for k, v in base.items()}


def amplification(cfg: Config, dense: dict, probe: dict,
                  by_name: dict[str, float] | None = None) -> dict[str, float]:
    """``A_m = |probe - dense|_m / (rho scale_m)`` per measure (``probe``: the dense step from
    ``perturbed_start``); the gradients' is the largest ``A_p`` (``by_name``, else computed)."""
    diff = five_measures(0, "probe", dense, probe)
    scales = auto_bounds(cfg, dense, 0.0)
    amp = {m: _ratio(diff[m], scales[m]) if scales[m] else 0.0
           for m in ("forward_max_abs_diff", "loss_abs_diff", "input_grad_max_abs_diff")}
    by_name = parameter_amplification(cfg, dense, probe) if by_name is None else by_name
    amp["parameter_grad_max_abs_diff"] = max(by_name.values())
    return amp


def parameter_amplification(cfg: Config, dense: dict, probe: dict) -> dict[str, float]:
    """``A_p`` by name: ``|probe - dense|`` of each gradient over its own bound."""
    grad = parameter_bounds(cfg, dense, 0.0)["parameter_grad_max_abs_diff"]
    return {k: (max_abs_diff(dense["grads"][k], probe["grads"][k]) / b if b else 0.0)
            for k, b in grad.items()}


def rounding_floors(cfg: Config, dense: dict, amp: dict[str, float], lr: float,
                    worst: dict | None = None, by_name: dict[str, float] | None = None) -> dict:
    """``FLOOR_SAFETY max(1, A_m) bound_m`` per measure (the weights' from the gradients'
    floor); parameter measures for ``worst``'s parameter (else the largest), with its own
    ``A_p`` from ``by_name`` (else the largest ``A``)."""
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


def conditioning(cfg: Config, dense: dict, probe: dict, lr: float,
                 worst: dict | None = None) -> tuple[dict, dict]:
    """``(rounding_floors, amplification)`` of ``dense`` and its ``probe``."""
    by_name = parameter_amplification(cfg, dense, probe)
    amp = amplification(cfg, dense, probe, by_name)
    return rounding_floors(cfg, dense, amp, lr, worst, by_name), amp


def apply_auto(metrics: dict, bounds: dict, floors=None) -> dict:
    """``run()``'s dict under ``tolerance="auto"``: the measures, ``tolerance``, ``bounds``,
    ``verdict`` and ``passed``: ``"pass"`` within every bound; else ``"inconclusive"`` (with
    ``reason``) within every one of ``floors`` (``conditioning``'s pair, or a function returning
    it), else ``"fail"``."""
    out = {k: v for k, v in metrics.items() if k != "passed"}
    out.update(tolerance="auto", bounds=dict(bounds))
    if all(metrics[m] <= bounds[m] for m in bounds):
        out["verdict"] = "pass"
    elif floors is None:
        out["verdict"] = "fail"
    else:
        floors, amp = floors() if callable(floors) else floors
        worst = max(amp.values())
        out.update(floors=dict(floors), amplification=worst)
        if all(metrics[m] <= floors[m] for m in bounds):
            out["verdict"] = "inconclusive"
            out["reason"] = (f"rounding is amplified ~{worst:.0f}x here (ill-conditioned "
                             f"step): every difference is within what amplified rounding "
                             f"reaches; re-run with init=fan_in or in float64")
        else:
            out["verdict"] = "fail"
    out["passed"] = out["verdict"] == "pass"
    return out
