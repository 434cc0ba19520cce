"""Rounding or a bug, at step N (chapter 20): a run's divergence from its dense twin per step
against the rounding envelope, log y, the step where it leaves marked."""
from __future__ import annotations

from tpattn.model.envelope import drift
from .style import DENSE_COLOR, FAIL_COLOR, PASS_COLOR, new_figure, side_legend

__all__ = ["envelope_figure"]

#: The envelope's shade and line.
ENVELOPE_COLOR = "#7f7f7f"


def envelope_figure(curves: dict, margin: float, title: str = ""):
    """``curves`` (``tpattn.model.envelope.judge_curves``' dict: ``divergence``,
    ``envelope`` ``[N]``, ``dense``, ``kind``, ``left``, ``text``) as one panel: the envelope
    (the K twins' largest divergence) and ``margin`` x it shaded, the run's divergence, the
    dense run's own drift (dotted: where the envelope is no longer informative), and a
    vertical line at the step where the run leaves it; log y."""
    div, env = curves["divergence"], curves["envelope"]
    if div.ndim != 1 or div.shape != env.shape or len(div) == 0:
        raise ValueError(f"curves: divergence and envelope must be two equal non-empty [N] "
                         f"tensors (got {tuple(div.shape)} and {tuple(env.shape)})")
    steps = range(1, len(div) + 1)
    floor = float(env[env > 0].min()) / 10 if bool((env > 0).any()) else 1e-12
    clip = lambda t: t.clamp(min=floor).nan_to_num(nan=1e3, posinf=1e3)  # noqa: E731
    fig, ax = new_figure(figsize=(7.0, 3.0))
    ax.fill_between(steps, floor, clip(margin * env), color=ENVELOPE_COLOR, alpha=0.18,
                    linewidth=0, label=f"rounding: {margin:g} x envelope")
    ax.plot(steps, clip(env), color=ENVELOPE_COLOR, linewidth=1.2,
            label="envelope (twins' largest)")
    color = FAIL_COLOR if curves["kind"] == "bug" else PASS_COLOR
    ax.plot(steps, clip(div), color=color, linewidth=1.6, label="TP run vs dense")
    ax.plot(steps, clip(drift(curves["dense"])), color=DENSE_COLOR, linestyle=":",
            linewidth=1.0, label="training's own drift")
    if curves["left"] is not None:
        ax.axvline(curves["left"], color=FAIL_COLOR, linestyle="--", linewidth=1.0)
        ax.annotate(f"leaves at step {curves['left']}", (curves["left"], floor),
                    xytext=(4, 4), textcoords="offset points", color=FAIL_COLOR, fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("SGD step")
    ax.set_ylabel("|W_run - W_dense| / |W_dense|")
    ax.set_title(title or curves["text"].split(" (")[0], fontsize=10)
    side_legend(ax)
    return fig

