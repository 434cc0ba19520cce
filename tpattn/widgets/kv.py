"""Chapter 13's explorer: query heads × KV heads × world size (× strategy) → the layout, the
replica groups, and what each ``kv_strategy`` holds and moves (live and static twins)."""
from __future__ import annotations

import functools
import html

import ipywidgets as widgets

from ..config import KV_STRATEGIES, Config
from ..kv_heads import GATHER_ACTIVATIONS, has_replicas, kv_costs, replica_groups
from ..viz.frames import heads_svg
from ..viz.kv import replica_groups_layout
from .core import Explorer, config_controls, config_panel, drawn_config, html_output
from .static import StaticExplorer

__all__ = ["KV_LAYOUTS", "kv_config", "kv_caption", "kv_explorer", "static_kv_explorer"]

#: (query_heads, kv_heads, world_size) precomputed for the book: GQA and MQA with fewer KV
#: heads than ranks, and one invalid layout (each an SVG of a few kB).
KV_LAYOUTS = ((8, 2, 4), (8, 1, 4), (4, 1, 2), (16, 2, 8), (8, 2, 3))
#: The figure stays readable up to this many query heads.
MAX_KV_DRAWN_HEADS = 32


def kv_config(query_heads, kv_heads, world_size, kv_strategy="replicate_weights") -> Config:
    """The fixture's ``Config`` with these heads, ranks and strategy (``drawn_config``)."""
    return drawn_config(MAX_KV_DRAWN_HEADS, query_heads=query_heads, kv_heads=kv_heads,
                        world_size=world_size, kv_strategy=kv_strategy)


def kv_caption(cfg: Config) -> tuple[str, str]:
    """Text and HTML under the kv picture: the replica groups, and what each ``kv_strategy``
    holds and sends per step (``kv_costs``)."""
    q = cfg.local_query_heads
    lines = []
    if has_replicas(cfg):
        groups = "; ".join(f"kv{h}: ranks {g[0]}–{g[-1]}" for h, g in enumerate(replica_groups(cfg)))
        lines.append(f"each KV head is read by {cfg.kv_replicas} ranks ({groups}); rank r holds "
                     f"q[{q}r, {q}r+{q}) and reads kv r//{cfg.kv_replicas}")
    else:
        lines.append(f"each rank holds {q} query and {cfg.local_kv_heads} whole KV head(s): "
                     f"no replicas, both strategies are the same code")
    costs = kv_costs(cfg)
    for s in KV_STRATEGIES:
        if s not in costs:
            lines.append(f"{s}: not possible here (kv_heads*head_dim % world_size != 0)")
            continue
        c = costs[s]
        how = ("all-gather + reduce-scatter over all ranks" if s == GATHER_ACTIVATIONS
               else f"all-reduce of wk/wv grads in groups of {cfg.kv_replicas}")
        if not has_replicas(cfg):
            how = "no KV collective"
        lines.append(f"{s}: holds {c['kv_weight_elements'] * 4} B of wk/wv, sends "
                     f"{c['kv_bytes_moved']} B per step ({how})")
    text = "\n".join(lines)
    markup = "".join(f'<p style="margin:0.15em 0">{html.escape(line)}</p>' for line in lines)
    return text, markup


def kv_explorer(query_heads: int = 8, kv_heads: int = 2, world_size: int = 4,
                kv_strategy: str = "replicate_weights") -> Explorer:
    """Which rank reads which KV head, the replica groups, and what each strategy moves; an
    invalid layout shows ``Config``'s own message."""
    controls = config_controls(query_heads=query_heads, kv_heads=kv_heads, world_size=world_size)
    controls["kv_strategy"] = widgets.ToggleButtons(options=list(KV_STRATEGIES), value=kv_strategy,
                                                    description="strategy",
                                                    style={"button_width": "auto"})

    @functools.lru_cache(maxsize=32)  # a layout shown again: its outputs, as they were
    def shown(cfg: Config) -> tuple[dict, dict]:
        text, markup = kv_caption(cfg)
        return (html_output(markup, text),
                html_output(heads_svg(replica_groups_layout(cfg)),
                            f"<replica groups, {cfg.query_heads}/{cfg.kv_heads}/"
                            f"{cfg.world_size}, {cfg.kv_strategy}>"))

    def draw(query_heads, kv_heads, world_size, kv_strategy):
        return list(shown(kv_config(query_heads, kv_heads, world_size, kv_strategy)))

    explorer = Explorer("kv", controls, draw, static=lambda: static_kv_explorer(
        initial=((query_heads, kv_heads, world_size), kv_strategy)))
    explorer.shown = shown
    return explorer


def static_kv_explorer(layouts=KV_LAYOUTS,
                       initial=((8, 2, 4), "replicate_weights")) -> StaticExplorer:
    """The live panels (caption, SVG) for each layout × strategy; an invalid one: the message."""
    layouts = [tuple(layout) for layout in layouts]
    panels = {(i, j): config_panel(lambda: kv_config(*layout, strategy), lambda cfg: (
        kv_caption(cfg)[1] + heads_svg(replica_groups_layout(cfg))))
        for i, layout in enumerate(layouts) for j, strategy in enumerate(KV_STRATEGIES)}
    labels = ["{} q · {} kv · {} ranks".format(*layout) for layout in layouts]
    layout0, strategy0 = initial
    start = (layouts.index(tuple(layout0)) if tuple(layout0) in layouts else 0,
             KV_STRATEGIES.index(strategy0))
    return StaticExplorer("kv", [("layout", labels), ("strategy", list(KV_STRATEGIES))], panels,
                          initial=start)
