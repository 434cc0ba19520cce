"""Part VI (chapter 20): where a run leaves the rounding envelope, and which LM bugs a step-1
loss comparison can see."""
from __future__ import annotations

import functools
import math

import torch

from tpattn.bugs.lm_zoo import lm_case
from tpattn.bugs.lm_curves import (CURVE_LM, CURVE_STEPS, MARGIN, mode_curves,
                                   training_modes)
from tpattn.bugs.lm_zoo import LM_EQUIVALENCE
from tpattn.exercises.graders import Wrong, exercise
from tpattn.model.envelope import dense_step_fn, make_batches, tp_step_fn
from tpattn.model.params import init_lm_params

#: Seeds of the step-1 exercise: the chapter's and one it never shows.
STEP_ONE_SEEDS = (11, 5)
#: A step-1 loss "differs" above this relative difference (float32 rounding is ~1e-7).
STEP_ONE_RTOL = 1e-5
#: The LM bugs whose chapter curves ``check_leaves`` runs besides correct TP: a forward bug and
#: a backward-only one (the chapter computes both).
LEAVES_BUGS = ("mlp_output_reduce_missing", "mlp_input_grad_reduce_missing")
#: Made-up ``(divergence, envelope, margin, first step outside or None)`` cases.
_MADE_UP = (
    ([1e-7, 2e-7, 3e-7], [1e-7, 1e-7, 1e-7], 4.0, None),
    ([1e-7, 5e-7, 3e-7], [1e-7, 1e-7, 1e-7], 4.0, 2),
    ([1e-7, 5e-7, 3e-7], [1e-7, 1e-7, 1e-7], 6.0, None),
    ([1e-7, 2e-7, math.nan, 1e-7], [1e-7, 1e-7, 1e-7, 1e-7], 4.0, 3),
    ([1e-3, 1e-7], [1e-7, 1e-7], 4.0, 1),
    ([4e-7, 4.1e-7], [1e-7, 1e-7], 4.0, 2),
)


def _leaves_cases() -> list[tuple]:
    """The made-up cases, then the chapter's curves of correct TP and ``LEAVES_BUGS`` (seed 11,
    ``CURVE_STEPS`` steps, float32)."""
    found = [tuple(torch.tensor(v, dtype=torch.float64) for v in case[:2]) + case[2:]
             for case in _MADE_UP]
    for mode in (LM_EQUIVALENCE,) + LEAVES_BUGS:
        c = mode_curves(mode, 11, CURVE_STEPS)
        found.append((c["divergence"], c["envelope"], MARGIN, c["left"]))
    return found


@exercise("where the run leaves the envelope", 20)
def check_leaves(leaves) -> str:
    """Check ``leaves(divergence [N], envelope [N], margin) -> int | None``: the first step
    (from 1) whose divergence exceeds margin x envelope or is NaN, else None."""
    cases = _leaves_cases()
    for div, env, margin, want in cases:
        got = leaves(div.clone(), env.clone(), margin)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = int(got)
        if got is not None and (isinstance(got, bool) or not isinstance(got, int)):
            raise Wrong(f"your function should return a step number (an int) or None, but it "
                        f"gave {type(got).__name__}.")
        if got == want:
            continue
        shown = ", ".join(f"{v:.2g}" for v in div.tolist()[:6])
        if want is not None and got == want - 1:
            raise Wrong(f"for divergence [{shown}, ...] you gave step {got}: steps count from 1 "
                        f"(the first update), not from 0.")
        if want is not None and bool(div[want - 1].isnan()):
            raise Wrong(f"for divergence [{shown}, ...] step {want} is NaN: a NaN is outside "
                        f"(a comparison with NaN is False, so test 'not inside').")
        raise Wrong(f"for divergence [{shown}, ...], envelope {env[0].item():.2g} ... and margin "
                    f"{margin:g} you gave {got!r}; the first step above margin x envelope is "
                    f"{want!r}.")
    return (f"right on {len(cases)} curves: {len(_MADE_UP)} made up (NaN among them) and the "
            f"chapter's correct TP and {len(cases) - len(_MADE_UP) - 1} LM bugs.")


@functools.lru_cache(maxsize=None)
def step_one_losses(mode: str, seed: int) -> tuple[float, float]:
    """``(TP loss, dense loss)`` of ``mode`` before the first update (the chapter's LM, float32,
    seed ``seed``'s parameters and first token batch)."""
    lm, prog, _ = lm_case(mode, CURVE_LM)
    params, tokens = init_lm_params(lm, seed), make_batches(lm, seed, 1)[0]
    return (tp_step_fn(lm, prog)(params, tokens)[0],
            dense_step_fn(lm, clip=prog.clip)(params, tokens)[0])


def step_one_differs(mode: str, seed: int) -> bool:
    """Whether ``mode``'s step-1 loss is off the dense one by more than ``STEP_ONE_RTOL``."""
    tp, dense = step_one_losses(mode, seed)
    return not abs(tp - dense) <= STEP_ONE_RTOL * abs(dense)


@exercise("what a step-1 loss check sees", 20)
def check_step_one(differs) -> str:
    """Check ``differs(mode, seed) -> bool``: whether the LM mode's loss before the first update
    is off the dense model's by more than ``STEP_ONE_RTOL`` (relative)."""
    modes = [LM_EQUIVALENCE] + training_modes()
    for seed in STEP_ONE_SEEDS:
        for mode in modes:
            got = differs(mode, seed)
            if isinstance(got, torch.Tensor) and got.numel() == 1:
                got = bool(got)
            if not isinstance(got, bool):
                raise Wrong(f"your function should return True or False, but it gave "
                            f"{type(got).__name__}.")
            want = step_one_differs(mode, seed)
            if got != want:
                tp, dense = step_one_losses(mode, seed)
                rel = abs(tp - dense) / abs(dense)
                raise Wrong(f"{mode} at seed {seed}: TP's step-1 loss {tp:.7g} vs dense "
                            f"{dense:.7g}, {rel:.2g} apart (relative), so it "
                            f"{'does' if want else 'does not'} differ beyond "
                            f"{STEP_ONE_RTOL:g}; you said it {'does' if got else 'does not'}.")
    blind = [m for m in training_modes() if not step_one_differs(m, STEP_ONE_SEEDS[0])]
    return (f"right for all {len(modes)} LM modes at {len(STEP_ONE_SEEDS)} seeds: a step-1 loss "
            f"check misses {len(blind)} of the {len(modes) - 1} bugs ({', '.join(blind)}).")
