"""How far float rounding alone can move a measure: the tolerance the numeric tests derive.

Every measure is ``max |a - b|`` of two tensors the block computed, ``a`` on the dense side and
``b`` on the TP side. Another CPU, BLAS, instruction set or thread count (or another
implementation, ``test_rederive``) computes each of them in a different order, so each lands
elsewhere by its own rounding error. The longest chain of rounding in the block is a sum of
``n`` terms, ``n = max(hidden, query_heads * head_dim, seq)`` (the Q/K/V projections sum over
``hidden``, ``wo`` over ``query_heads * head_dim``, attention over ``seq``); the standard bound
on an ``n``-term float sum is ``n * u * sum|terms|`` with the unit roundoff ``u = eps / 2``
(recursive summation; N. J. Higham, "The Accuracy of Floating Point Summation", SIAM J. Sci.
Comput. 14, 783-799, 1993), and ``sum|terms|`` is
of the order of the largest value compared, ``scale``. So one computation of ``a`` and another
differ by at most ``2 * n * u * scale`` (both within ``n * u * scale`` of the exact value), the
same for ``b``, and the measure ``|a - b|`` moves by at most the sum of the two::

    atol = 4 * n * u * scale = 2 * n * eps * scale

For the seed's Config ``n = 16``: ``32 * 2**-23 * scale``, ~1.5e-5 for outputs of magnitude 4,
~2e-7 for input gradients of magnitude 0.05. Measured across the kernel settings of
``make test-portable`` and on an AVX-512 CPU the measures moved by at most ~2.4e-7 (one float32
step of a loss near 2): well inside. The bug measures are 1e-4 .. 1 and stay > 150 times above
``atol``, so a 1 % change of any of them still fails
(``test_golden.test_a_one_percent_change_of_a_bug_measure_is_caught``).
"""
from __future__ import annotations

import functools

import torch

from tpattn import MEASURES, Config


def longest_sum(cfg: Config) -> int:
    """Terms in the longest float sum of the block (see the module docstring)."""
    return max(cfg.hidden, cfg.query_heads * cfg.head_dim, cfg.seq)


def assert_within_sum_bound(a: torch.Tensor, b: torch.Tensor, cfg: Config, what: str) -> None:
    """Assert ``max |a - b| <= 2 * longest_sum(cfg) * eps * max(|a|, |b|, 1)``: two ways of
    computing the same sums differ by at most a rounding per term of the longest one."""
    eps = torch.finfo(a.dtype).eps
    scale = max(a.abs().max().item(), b.abs().max().item(), 1.0)
    bound = 2 * longest_sum(cfg) * eps * scale
    diff = (a - b).abs().max().item()
    assert diff <= bound, f"{what}: {diff:.3e} > {bound:.3e}"


def _max_abs(*tensors) -> float:
    return max(t.detach().abs().max().item() for t in tensors)


def scales(dense: dict, tp: dict) -> dict[str, float]:
    """The largest magnitude each measure compares, from the two sides' ``one_step`` tensors."""
    return {
        "forward_max_abs_diff": _max_abs(dense["output"], tp["output"]),
        "loss_abs_diff": _max_abs(dense["loss"], tp["loss"]),
        "input_grad_max_abs_diff": _max_abs(dense["input_grad"], tp["input_grad"]),
        "parameter_grad_max_abs_diff": _max_abs(*dense["grads"].values(), *tp["grads"].values()),
        "post_step_weight_max_abs_diff": _max_abs(*dense["weights"].values(), *tp["weights"].values()),
    }


def tolerances(cfg: Config, scale: dict[str, float]) -> dict[str, float]:
    """``atol = 2 * n * eps * scale`` for each measure (``eps`` of ``cfg.dtype``)."""
    eps = torch.finfo(cfg.torch_dtype).eps
    n = longest_sum(cfg)
    return {m: 2 * n * eps * scale[m] for m in MEASURES}


@functools.lru_cache(maxsize=None)
def run_tolerances(seed: int, mode: str, cfg: Config | None = None) -> dict[str, float]:
    """The tolerances for ``tpattn.run(seed, mode, cfg)``'s measures, from the run's own tensors."""
    from tpattn import tp_forward
    from tpattn.check.core import (MISSING_INPUT_GRAD_REDUCE, MISSING_OUTPUT_REDUCE, PARAM_SEED_OFFSET,
                              dense_reference, make_inputs, one_step)
    from tpattn.block.params import init_params

    cfg = Config() if cfg is None else cfg
    x0, target = make_inputs(cfg, seed)
    base = init_params(cfg, seed + PARAM_SEED_OFFSET)

    def tp(x, p):
        return tp_forward(x, p, cfg, reduce_output=mode != MISSING_OUTPUT_REDUCE,
                          reduce_input_grad=mode != MISSING_INPUT_GRAD_REDUCE)

    dense = dense_reference(x0, target, base, cfg)
    return tolerances(cfg, scales(dense, one_step(tp, x0, target, base)))
