"""The five measures of a check: max-abs differences of two steps' tensors, and the verdict."""
from __future__ import annotations

import torch

__all__ = ["MEASURES", "TOLERANCE", "DIFF_CHUNK", "max_abs_diff", "five_measures"]

#: The five measures, in the order they are reported.
MEASURES = (
    "forward_max_abs_diff",
    "loss_abs_diff",
    "input_grad_max_abs_diff",
    "parameter_grad_max_abs_diff",
    "post_step_weight_max_abs_diff",
)
#: A measure passes below this (float32 rounding at the original fixture's size is ~1e-7).
TOLERANCE = 1e-6
#: ``max_abs_diff`` works through tensors larger than this in pieces of this many elements.
DIFF_CHUNK = 1 << 20


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` as a float (NaN if any difference is), in ``DIFF_CHUNK`` pieces through
    one buffer above that size (no temporary as large as the tensor)."""
    a, b = a.detach(), b.detach()
    n = a.numel()
    if n <= DIFF_CHUNK or a.shape != b.shape:
        return (a - b).abs().max().item()
    fa, fb = a.reshape(-1), b.reshape(-1)
    buf = torch.empty(DIFF_CHUNK, dtype=torch.result_type(a, b))
    peaks = [torch.sub(fa[i:i + DIFF_CHUNK], fb[i:i + DIFF_CHUNK],
                       out=buf[:min(DIFF_CHUNK, n - i)]).abs_().max()
             for i in range(0, n, DIFF_CHUNK)]
    return torch.stack(peaks).max().item()


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
