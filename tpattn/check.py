"""The check: one dense step and one TP step from the same start, compared on five measures.

``run(seed, mode)`` returns the seed fixture's dict — same keys, same order, same floats::

    seed, mode,
    forward_max_abs_diff, loss_abs_diff, input_grad_max_abs_diff,
    parameter_grad_max_abs_diff, post_step_weight_max_abs_diff,
    passed            (every measure < TOLERANCE)
"""
from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

from .config import Config
from .dense import dense_forward
from .params import clone_trainable, init_params
from .rank_batched import rank_batched_tp_forward
from .tolerance import apply_auto, auto_bounds, check_tolerance
from .tp import tp_forward

EQUIVALENCE = "equivalence"
MISSING_OUTPUT_REDUCE = "missing_output_reduce"
MISSING_INPUT_GRAD_REDUCE = "missing_input_grad_reduce"
#: The three TP variants, in the seed's order.
MODES = (EQUIVALENCE, MISSING_OUTPUT_REDUCE, MISSING_INPUT_GRAD_REDUCE)
#: The seeds of the seed fixture's matrix.
SEEDS = (11, 17, 23, 29, 31)
#: The five measures, in the order they are reported.
MEASURES = (
    "forward_max_abs_diff",
    "loss_abs_diff",
    "input_grad_max_abs_diff",
    "parameter_grad_max_abs_diff",
    "post_step_weight_max_abs_diff",
)
#: A measure passes when it is below this (absolute; float32 rounding at the seed's size is ~1e-7).
TOLERANCE = 1e-6
#: Learning rate of the one SGD step.
LR = 0.05
#: ``init_params`` draws from ``seed + PARAM_SEED_OFFSET`` (inputs come from ``seed`` itself).
PARAM_SEED_OFFSET = 100
_SEED_MAX = 2**63 - 1 - PARAM_SEED_OFFSET


def check_mode(mode: str) -> str:
    """Return ``mode`` if it is one of ``MODES``, else raise ``ValueError`` naming the choices."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
    return mode


def check_seed(seed: int) -> int:
    """Return ``seed`` if it is an integer in ``[0, 2**63 - 101]``, else raise ``ValueError``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _SEED_MAX:
        raise ValueError(f"seed must be an integer in [0, {_SEED_MAX}] (got {seed!r})")
    return seed


def make_inputs(cfg: Config, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ``x`` and regression target, both ``[S, B, hidden]``, from the global RNG seeded
    with ``seed`` (drawn in float32, then cast to ``cfg.dtype``)."""
    torch.manual_seed(seed)
    x = torch.randn(cfg.seq, cfg.batch, cfg.hidden)
    target = torch.randn_like(x)
    return x.to(cfg.torch_dtype), target.to(cfg.torch_dtype)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` as a Python float."""
    return (a - b).abs().max().detach().item()


def one_step(forward, x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor]) -> dict:
    """One training step of the fixture: ``forward(x, params) -> y``, MSE loss, backward, SGD.

    x0, target: ``[S, B, hidden]``; ``base``: the starting parameters (copied, not touched).
    Returns the tensors the five measures compare: ``output`` ``[S, B, hidden]``, ``loss``,
    ``input_grad`` ``[S, B, hidden]``, ``grads`` and ``weights`` (after the step), by name.
    """
    p = clone_trainable(base)
    x = x0.clone().requires_grad_(True)
    y = forward(x, p)
    loss = F.mse_loss(y, target)
    loss.backward()
    with torch.no_grad():
        weights = {k: p[k] - LR * p[k].grad for k in p}
    return {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad,
            "grads": {k: p[k].grad for k in p}, "weights": weights}


def dense_reference(x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor],
                    cfg: Config) -> dict:
    """``one_step`` of the dense block: the side every TP variant is compared against."""
    return one_step(lambda x, p: dense_forward(x, p, cfg), x0, target, base)


def five_measures(seed: int, mode: str, dense: dict, tp: dict) -> dict:
    """``run()``'s dict from the two sides' ``one_step`` tensors: the five max-abs differences
    and ``passed`` (every one below ``TOLERANCE``)."""
    metrics = {
        "seed": seed,
        "mode": mode,
        "forward_max_abs_diff": max_abs_diff(dense["output"], tp["output"]),
        "loss_abs_diff": max_abs_diff(dense["loss"], tp["loss"]),
        "input_grad_max_abs_diff": max_abs_diff(dense["input_grad"], tp["input_grad"]),
        "parameter_grad_max_abs_diff": max(max_abs_diff(dense["grads"][k], tp["grads"][k])
                                           for k in dense["grads"]),
        "post_step_weight_max_abs_diff": max(max_abs_diff(dense["weights"][k], tp["weights"][k])
                                             for k in dense["weights"]),
    }
    metrics["passed"] = all(metrics[m] < TOLERANCE for m in MEASURES)
    return metrics


def run(seed: int = 11, mode: str = EQUIVALENCE, cfg: Config | None = None,
        tolerance: str = "seed") -> dict:
    """Dense vs TP from the same inputs and weights: forward, MSE loss, backward, one SGD step.

    ``mode`` picks the TP variant: ``equivalence`` (both reductions), ``missing_output_reduce``
    (no g), ``missing_input_grad_reduce`` (no f). Returns the five measures and ``passed``.

    ``tolerance="seed"``: the seed's absolute ``TOLERANCE`` and the seed's digits
    (``tp.tp_forward``). ``tolerance="auto"``: a rounding bound per measure
    (``tolerance.auto_bounds``, added as ``bounds``) and the rank-batched TP path
    (``rank_batched.rank_batched_tp_forward``: same math, faster, no bit parity promised).
    """
    check_mode(mode)
    check_seed(seed)
    check_tolerance(tolerance)
    cfg = Config() if cfg is None else cfg
    x0, target = make_inputs(cfg, seed)
    base = init_params(cfg, seed + PARAM_SEED_OFFSET)
    forward = tp_forward if tolerance == "seed" else rank_batched_tp_forward

    def tp(x, p):
        return forward(x, p, cfg, reduce_output=mode != MISSING_OUTPUT_REDUCE,
                       reduce_input_grad=mode != MISSING_INPUT_GRAD_REDUCE)

    dense = dense_reference(x0, target, base, cfg)
    metrics = five_measures(seed, mode, dense, one_step(tp, x0, target, base))
    if tolerance == "auto":
        metrics = apply_auto(metrics, auto_bounds(cfg, dense, LR))
    return metrics


def run_matrix(seeds=SEEDS, modes=MODES, cfg: Config | None = None,
               tolerance: str = "seed") -> list[dict]:
    """``run`` for every mode × seed, mode-major (all seeds of the first mode first), as the seed."""
    modes = [check_mode(m) for m in modes]
    seeds = [check_seed(s) for s in seeds]
    check_tolerance(tolerance)
    return [run(s, m, cfg, tolerance) for m in modes for s in seeds]


def inspect_fixture(cfg: Config | None = None) -> dict:
    """The seed's ``inspect``: runtime versions, Config, dense and rank-local shapes, the rule.

    For the default float32 Config this is the seed's dict exactly; a float64 Config adds
    ``config["dtype"]``.
    """
    cfg = Config() if cfg is None else cfg
    config = cfg.as_dict()
    if config["dtype"] == Config.dtype:
        del config["dtype"]  # the seed's Config has no dtype field
    return {
        "python": platform.python_version(),
        "pytorch": torch.__version__,
        "config": config,
        "dense_shapes": {
            "x": [cfg.seq, cfg.batch, cfg.hidden],
            "q": [cfg.seq, cfg.batch, cfg.query_heads, cfg.head_dim],
            "k_v": [cfg.seq, cfg.batch, cfg.kv_heads, cfg.head_dim],
        },
        "rank_local": {"query_heads": cfg.local_query_heads, "kv_heads": cfg.local_kv_heads},
        "rule": "keep complete query/KV groups on each rank; sum output-projection partials",
    }
