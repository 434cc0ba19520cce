"""The loss-curve explorer (chapter 20): steps × seed × LM mode × dtype → the run's divergence
from its dense twin, the rounding envelope, and the verdict."""
from __future__ import annotations

import ipywidgets as widgets
import numpy as np

from tpattn.bugs.lm_curves import CURVE_STEPS, MARGIN, mode_curves
from tpattn.bugs.lm_zoo import LM_EQUIVALENCE, LM_REGISTRY
from tpattn.viz.envelope import envelope_figure
from .core import (Explorer, control_states, encode_png, png_output, seed_control,
                   single_thread, text_output)

__all__ = ["loss_curve_explorer", "verdict_line", "MAX_STEPS", "EXPLORER_STEPS"]

#: The most steps the explorer trains (about 3 s at the chapter's shape, float32).
MAX_STEPS = 60
#: The step count of the static twin.
EXPLORER_STEPS = CURVE_STEPS
#: The dtypes the explorer offers.
EXPLORER_DTYPES = ("float32", "bfloat16")


def verdict_line(curves: dict) -> str:
    """One line: the mode, the verdict and the largest divergence / envelope ratio."""
    ratio = curves["ratio"]
    worst = float(ratio.nan_to_num(nan=float("inf")).max())
    return (f"{curves['mode']}, {len(ratio)} steps: {curves['text']}; largest divergence / "
            f"envelope {worst:.3g} at step {int(ratio.nan_to_num(nan=float('inf')).argmax()) + 1}"
            f" (a bug is a ratio above {MARGIN:g})")


def _checked_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be an integer from 1 to {MAX_STEPS} (got {steps!r})")
    return steps


def draw_curves(steps: int, seed: int, mode: str, dtype: str) -> list[dict]:
    """The verdict line and the figure of ``mode_curves(mode, seed, steps, dtype)``."""
    with single_thread():
        curves = mode_curves(mode, seed, _checked_steps(steps), dtype)
    fig = envelope_figure(curves, MARGIN, title=f"{mode} ({dtype}, seed {seed})")
    fig.canvas.draw()
    png = encode_png(np.asarray(fig.canvas.buffer_rgba()))
    line = verdict_line(curves)
    return [text_output(line), png_output(png, line)]


def loss_curve_explorer(steps: int = EXPLORER_STEPS, seed: int = 11, mode: str = LM_EQUIVALENCE,
                        dtype: str = "float32") -> Explorer:
    """Live: any step count up to ``MAX_STEPS``, seed, LM mode and dtype; the static twin:
    every mode of ``LM_REGISTRY`` in both dtypes at ``steps`` and ``seed``."""
    controls = {
        "steps": widgets.IntSlider(value=steps, min=1, max=MAX_STEPS, description="steps",
                                   continuous_update=False),
        "seed": seed_control(seed),
        "mode": widgets.Dropdown(options=list(LM_REGISTRY), value=mode, description="mode",
                                 layout=widgets.Layout(width="26em")),
        "dtype": widgets.ToggleButtons(options=list(EXPLORER_DTYPES), value=dtype,
                                       description="dtype"),
    }
    states = [control_states("mode", list(LM_REGISTRY)),
              control_states("dtype", EXPLORER_DTYPES)]
    return Explorer("loss curve", controls, draw_curves, states, kind="loss-curve",
                    note=f"Precomputed at {steps} steps, seed {seed}. Run the notebook for any "
                         f"step count, seed, mode and dtype.")
