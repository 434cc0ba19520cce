"""The bug-hunt explorer (chapter 17): pick a hunt and a cause; the panel shows what the run
shows (``bug_hunt.describe``) and whether the guess is right (``bug_hunt.judge``)."""
from __future__ import annotations

import html

import ipywidgets as widgets

from ..bug_hunt import choices, describe, hunt_case, judge
from ..observe import observe
from .core import Explorer, html_output, single_thread
from .static import StaticExplorer

__all__ = ["bug_hunt_explorer", "static_bug_hunt_explorer", "HUNTS", "hunt_panel"]

#: The hunts the HTML book precomputes.
HUNTS = (1, 2, 3, 4, 6, 9, 10, 25)
#: The answer control's "nothing chosen yet" option.
UNANSWERED = "(choose a cause)"


def _observe(hunt: int) -> tuple[str, dict]:
    # the engine's simulated ranks (tpattn.parallel.simulated)
    mode, seed, cfg = hunt_case(hunt)
    with single_thread():
        return mode, observe(mode, seed, cfg)


def hunt_panel(hunt: int, guess: str, cache: dict | None = None) -> tuple[str, str]:
    """``(html, text)`` of hunt ``hunt`` with answer ``guess`` (or ``UNANSWERED``)."""
    cache = {} if cache is None else cache
    if hunt not in cache:
        cache[hunt] = _observe(hunt)
    mode, obs = cache[hunt]
    lines = describe(obs)
    text = [f"hunt {hunt}: what the run shows"] + ["  " + line for line in lines]
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    markup = f"<p><strong>hunt {hunt}: what the run shows</strong></p><ul>{items}</ul>"
    if guess != UNANSWERED:
        right, why = judge(obs, mode, guess)
        color = "#2ca02c" if right else "#d62728"
        markup += (f'<p style="border-left: 4px solid {color}; padding: 0.3em 0.7em">'
                   f"{html.escape(why)}</p>")
        text.append(why)
    return markup, "\n".join(text)


def bug_hunt_explorer(hunt: int = 1) -> Explorer:
    """Live bug hunt: ``hunt`` (any integer >= 0) and the reader's answer."""
    cache: dict = {}
    controls = {"hunt": widgets.IntText(value=hunt, description="hunt",
                                        layout=widgets.Layout(width="11em")),
                "guess": widgets.Dropdown(options=[UNANSWERED] + choices(), value=UNANSWERED,
                                          description="cause",
                                          layout=widgets.Layout(width="24em"))}

    def draw(hunt, guess):
        markup, text = hunt_panel(hunt, guess, cache)
        return [html_output(markup, text)]

    return Explorer("bug hunt", controls, draw, static=lambda: static_bug_hunt_explorer())


def static_bug_hunt_explorer(hunts=HUNTS) -> StaticExplorer:
    """Every ``hunts`` x answer, precomputed (text only: no figures)."""
    answers = [UNANSWERED] + choices()
    cache: dict = {}
    panels = {(i, j): hunt_panel(h, a, cache)[0]
              for i, h in enumerate(hunts) for j, a in enumerate(answers)}
    return StaticExplorer("bug-hunt", [("hunt", [str(h) for h in hunts]), ("cause", answers)],
                          panels, initial=(0, 0),
                          note="Precomputed hunts. Run the notebook for any hunt number.")
