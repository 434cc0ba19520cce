"""Part I, the dense block (chapter 5): one training step and the five measures."""
from __future__ import annotations

import torch

from tpattn.block.params import PARAM_NAMES
from tpattn.bugs.modes import resolve
from tpattn.check.core import LR, MEASURES, MODES, dense_reference, five_measures, tp_step
from tpattn.exercises.graders import (CHECKED_CONFIGS, CHECKED_SEEDS, Wrong, cases, coverage,
                                      exercise, failing, shape_text, tensor)

_STEP_KEYS = ("output", "loss", "input_grad", "grads", "weights")
_STEP_HINTS = {
    "forward_max_abs_diff": "the output is not the dense block's: run "
                            "tpattn.dense_forward(x, p, cfg) on trainable copies of the inputs",
    "loss_abs_diff": "the loss is not the fixture's: the mean squared error of the output "
                     "against the target (torch.nn.functional.mse_loss)",
    "input_grad_max_abs_diff": "the input gradient is wrong: it is the .grad of a copy of x0 "
                               "that requires grad, after one backward of the loss",
    "parameter_grad_max_abs_diff": "the parameter gradients are wrong: they are the .grad of "
                                   "the trainable copies after one backward of the loss",
    "post_step_weight_max_abs_diff": f"the weights after the step are wrong: one SGD step "
                                     f"moves each parameter against its gradient, scaled by "
                                     f"the learning rate tpattn.check.core.LR = {LR}",
}
_MEASURE_HINTS = {
    "forward_max_abs_diff": "the largest absolute difference of the outputs",
    "loss_abs_diff": "the absolute difference of the losses",
    "input_grad_max_abs_diff": "the largest absolute difference of the input gradients",
    "parameter_grad_max_abs_diff": "the largest absolute difference over the gradients of all "
                                   "five parameters",
    "post_step_weight_max_abs_diff": "the largest absolute difference over all five "
                                     "parameters after the step"}


def _step_dict(step) -> None:
    """``Wrong`` unless ``step`` is a ``one_step`` dict of tensors."""
    if not isinstance(step, dict) or any(k not in step for k in _STEP_KEYS):
        raise Wrong(f"your step should return a dict with the keys {', '.join(_STEP_KEYS)}.")
    if step["input_grad"] is None:
        raise Wrong("input_grad is None: x has no gradient — make a copy of x0 that "
                    "requires grad before the forward.")
    for key in ("grads", "weights"):
        if not isinstance(step[key], dict) or any(
                not isinstance(step[key].get(k), torch.Tensor) for k in PARAM_NAMES):
            raise Wrong(f"step['{key}'] should map each of {', '.join(PARAM_NAMES)} to a tensor.")
    for key in ("output", "loss", "input_grad"):
        tensor(step[key], f"step['{key}']")


@exercise("one SGD step", 5)
def check_train_step(train_step) -> str:
    """Check ``train_step(x0, target, params, cfg) -> dict``: one SGD step of the dense block on
    copies of ``params``, as ``tpattn.check.core.one_step`` returns it."""
    for cfg, seed, x0, target, base in cases():
        before = {k: v.clone() for k, v in base.items()}
        x_before = x0.clone()
        step = train_step(x0, target, base, cfg)
        if not all(torch.equal(base[k], before[k]) for k in base) or not torch.equal(x0, x_before):
            raise Wrong("your step changed the starting parameters or x0 in place; the step "
                        "must work on trainable copies (tpattn.clone_trainable) so the start "
                        "stays available for the dense-vs-TP comparison.")
        _step_dict(step)
        metrics = five_measures(seed, "your step", dense_reference(x0, target, base, cfg), step)
        if failing(metrics):
            first = failing(metrics)[0]
            raise Wrong(f"for seed {seed}, {shape_text(cfg)}, {_STEP_HINTS[first]} (differs from "
                        f"the reference by {metrics[first]:.1e}).")
    return (f"your step matches the dense reference on all five measures for {coverage()}, "
            f"and leaves its inputs untouched.")


def _grade_measures(got, want: dict, where: str) -> None:
    """``Wrong`` unless ``got`` holds ``want``'s five measures, each up to one float32 rounding."""
    if not isinstance(got, dict):
        raise Wrong(f"your function should return a dict keyed by the five measure "
                    f"names, but it gave {type(got).__name__}.")
    missing = [m for m in MEASURES if m not in got]
    if missing:
        raise Wrong(f"your dict lacks {', '.join(missing)}; the keys are tpattn.MEASURES.")
    for m in MEASURES:
        try:
            value = float(got[m])
        except (TypeError, ValueError):
            raise Wrong(f"{m} should be a number, but your code gave "
                        f"{type(got[m]).__name__}.") from None
        if not abs(value - want[m]) <= 1e-6 * abs(want[m]) + 1e-12:
            raise Wrong(f"{m} is not {_MEASURE_HINTS[m]}: for {where} yours is "
                        f"{value:.2e}, the package's {want[m]:.2e}.")


@exercise("the five measures", 5)
def check_five_measures(measures) -> str:
    """Check ``measures(dense, tp) -> dict``: the five measures between two ``one_step`` dicts."""
    configs = CHECKED_CONFIGS[:2]
    for cfg, seed, x0, target, base in cases(configs):
        dense = dense_reference(x0, target, base, cfg)
        for mode in MODES:
            tp = tp_step(x0, target, base, cfg, resolve(mode, cfg).injection, "ranks")
            want = five_measures(seed, mode, dense, tp)
            _grade_measures(measures(dense, tp), want, f"seed {seed}, {mode}, {shape_text(cfg)}")
    return (f"all five of your measures agree with the package's on "
            f"{len(configs) * len(CHECKED_SEEDS) * len(MODES)} comparisons: "
            f"every mode, {len(CHECKED_SEEDS)} seeds, two shapes (up to 4 ranks).")
