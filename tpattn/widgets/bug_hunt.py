"""The bug-hunt explorer (chapter 18): what a run shows, whether a guess is right, the diagnosis."""
from __future__ import annotations

import functools
import html

import ipywidgets as widgets

from tpattn.diagnosis.diagnose import TIERS, diagnose
from tpattn.diagnosis.hunt import choices, describe, hunt_case, judge
from tpattn.diagnosis.observe import observe
from .core import Explorer, control_states, html_output, seed_control, single_thread

__all__ = ["bug_hunt_explorer", "PRECOMPUTED_HUNTS", "hunt_panel"]

#: The hunts the HTML book precomputes.
PRECOMPUTED_HUNTS = (1, 2, 3, 4, 6, 9, 10, 25)
#: The answer control's "nothing chosen yet" option.
UNANSWERED = "(choose a cause)"


@functools.lru_cache(maxsize=64)
def _observe(hunt: int) -> tuple[str, dict]:  # remembered: never modify it
    mode, seed, cfg = hunt_case(hunt)
    with single_thread():
        return mode, observe(mode, seed, cfg)


def hunt_panel(hunt: int, guess: str) -> tuple[str, str]:
    """``(html, text)`` of hunt ``hunt`` with answer ``guess`` (or ``UNANSWERED``)."""
    mode, obs = _observe(hunt)
    lines = describe(obs)
    best = diagnose(obs)[0]
    title = f"hunt {hunt}: what the run shows (tier {best['tier']}: {TIERS[best['tier']]})"
    text = [title] + ["  " + line for line in lines]
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    markup = f"<p><strong>{html.escape(title)}</strong></p><ul>{items}</ul>"
    if guess != UNANSWERED:
        right, why = judge(obs, mode, guess)
        color = "#2ca02c" if right else "#d62728"
        said = (f"tpattn.diagnose at tier {best['tier']}: "
                + " + ".join([best["cause"], *best["with"]])
                + (f"; tied with {', '.join(best['tied_with'])}" if best["tied_with"] else ""))
        markup += (f'<p style="border-left: 4px solid {color}; padding: 0.3em 0.7em">'
                   f"{html.escape(why)}</p><p>{html.escape(said)}</p>")
        text += [why, said]
    return markup, "\n".join(text)


def bug_hunt_explorer(hunt: int = 1, hunts=PRECOMPUTED_HUNTS) -> Explorer:
    """Live bug hunt and the reader's answer; the static twin: ``hunts`` × answers."""
    answers = [UNANSWERED] + choices()
    controls = {"hunt": seed_control(hunt, "hunt"),
                "guess": widgets.Dropdown(options=answers, value=UNANSWERED, description="cause",
                                          layout=widgets.Layout(width="24em"))}
    def draw(hunt, guess):
        return [html_output(*hunt_panel(hunt, guess))]
    states = [control_states("hunt", hunts), control_states("guess", answers, "cause")]
    return Explorer("bug hunt", controls, draw, states, kind="bug-hunt",
                    note="Precomputed hunts. Run the notebook for any hunt number.")
