"""Heads explorers (chapters 6 and 13): a layout's caption and the SVG of its heads picture."""
from __future__ import annotations

import functools
from typing import Callable

import ipywidgets as widgets

from tpattn.config import KV_STRATEGIES, Config
from tpattn.parallel.kv_heads import GATHER_ACTIVATIONS, has_replicas, kv_costs, replica_groups
from tpattn.viz.heads import HeadsPicture, heads_svg, replica_groups_layout
from .core import (Explorer, config_controls, control_states, drawn_config, html_output,
                   text_output)

__all__ = ["layout_states", "heads_explorer", "KV_LAYOUTS", "kv_caption", "kv_explorer"]

#: (query_heads, kv_heads, world_size) precomputed for the book; the last is invalid.
KV_LAYOUTS = ((8, 2, 4), (8, 1, 4), (4, 1, 2), (16, 2, 8), (8, 2, 3))
MAX_KV_DRAWN_HEADS = 32


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


def kv_caption(cfg: Config) -> str:
    """The replica groups, and what each ``kv_strategy`` holds and sends per step."""
    q = cfg.local_query_heads
    if has_replicas(cfg):
        groups = "; ".join(f"kv{h}: ranks {g[0]}–{g[-1]}" for h, g in enumerate(replica_groups(cfg)))
        lines = [f"each KV head is read by {cfg.kv_replicas} ranks ({groups}); rank r holds "
                 f"q[{q}r, {q}r+{q}) and reads kv r//{cfg.kv_replicas}"]
    else:
        lines = [f"each rank holds {q} query and {cfg.local_kv_heads} whole KV head(s): "
                 f"no replicas, both strategies are the same code"]
    costs = kv_costs(cfg)
    for s in KV_STRATEGIES:
        if s not in costs:
            lines.append(f"{s}: not possible here (kv_heads*head_dim % world_size != 0)")
            continue
        how = ("no KV collective" if not has_replicas(cfg)
               else "all-gather + reduce-scatter over all ranks" if s == GATHER_ACTIVATIONS
               else f"all-reduce of wk/wv grads in groups of {cfg.kv_replicas}")
        lines.append(f"{s}: holds {costs[s]['kv_weight_elements'] * 4} B of wk/wv, sends "
                     f"{costs[s]['kv_bytes_moved']} B per step ({how})")
    return "\n".join(lines)


def kv_explorer(query_heads: int = 8, kv_heads: int = 2, world_size: int = 4,
                kv_strategy: str = "replicate_weights", layouts=KV_LAYOUTS) -> Explorer:
    """Which rank reads which KV head; the static twin: ``layouts`` × strategies."""
    controls = config_controls(query_heads=query_heads, kv_heads=kv_heads, world_size=world_size)
    controls["kv_strategy"] = widgets.ToggleButtons(options=list(KV_STRATEGIES), value=kv_strategy,
                                                    description="strategy",
                                                    style={"button_width": "auto"})
    states = [layout_states(layouts), control_states("kv_strategy", KV_STRATEGIES, "strategy")]
    return heads_explorer("kv", controls, MAX_KV_DRAWN_HEADS, kv_caption, replica_groups_layout,
                          states)
