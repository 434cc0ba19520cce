"""Heads explorers' common part (chapters 6 and 13), and the static twins' groups of states."""
from __future__ import annotations

import functools
from typing import Callable

from tpattn.config import Config
from tpattn.viz.frames import HeadsPicture, heads_svg
from .core import Explorer, drawn_config, html_output, text_output

__all__ = ["control_states", "layout_states", "heads_explorer"]


def control_states(name: str, values, group: str | None = None) -> tuple[str, list]:
    """A static twin's group: control ``name`` at each of ``values``."""
    return group or name, [(str(value), {name: value}) for value in values]


def layout_states(layouts) -> tuple[str, list]:
    """A static twin's group of ``(query_heads, kv_heads, world_size)`` layouts."""
    return "layout", [("{} q · {} kv · {} ranks".format(*layout),
                       dict(zip(("query_heads", "kv_heads", "world_size"), layout)))
                      for layout in layouts]


def heads_explorer(kind: str, controls: dict, max_heads: int, caption: Callable[[Config], str],
                   picture: Callable[[Config], HeadsPicture], states) -> Explorer:
    """Controls → ``drawn_config(max_heads, **values)`` → its caption and the SVG of
    ``picture(cfg)``, cached (``explorer.shown``)."""
    @functools.lru_cache(maxsize=32)
    def shown(cfg: Config) -> tuple[dict, dict]:
        what = f"{cfg.query_heads} q, {cfg.kv_heads} kv, {cfg.world_size} ranks"
        return text_output(caption(cfg)), html_output(heads_svg(picture(cfg)), f"<{what}>")

    explorer = Explorer(kind, controls, lambda **values: list(shown(drawn_config(
        max_heads, **values))), states, kind=kind)
    explorer.shown = shown
    return explorer
