"""Chapter 13's explorer: query heads × KV heads × world size (× strategy) → the layout, the
replica groups, and what each ``kv_strategy`` holds and moves (live and static twins)."""
from __future__ import annotations

import functools
import html

import ipywidgets as widgets

from ..config import KV_STRATEGIES, Config
from ..kv_heads import GATHER_ACTIVATIONS, has_replicas, kv_costs, replica_groups
from ..viz.kv import replica_groups_figure, replica_groups_frame, set_replica_groups
from ..viz.frames import layout_dynamic_artists
from .core import (Explorer, Renders, StandingFigure, config_controls, html_output, message_html,
                   png_img, png_output)
from .pasting import HEADS_FRAME_FAMILIES, PastingStandingFigure
from .static import StaticExplorer

__all__ = ["KV_LAYOUTS", "kv_config", "kv_explorer", "static_kv_explorer"]

#: (query_heads, kv_heads, world_size) precomputed for the book: GQA and MQA with fewer KV
#: heads than ranks, and one invalid layout (each figure costs ~0.5 s of build time).
KV_LAYOUTS = ((8, 2, 4), (8, 1, 4), (4, 1, 2), (16, 2, 8), (8, 2, 3))
#: The figure stays readable up to this many query heads.
MAX_KV_DRAWN_HEADS = 32


def kv_config(query_heads, kv_heads, world_size, kv_strategy="replicate_weights") -> Config:
    """The fixture's ``Config`` with these heads, ranks and strategy (``Config``'s own
    ``ValueError`` if invalid; ``ValueError`` too above ``MAX_KV_DRAWN_HEADS`` query heads)."""
    cfg = Config(query_heads=query_heads, kv_heads=kv_heads, world_size=world_size,
                 kv_strategy=kv_strategy)
    if cfg.query_heads > MAX_KV_DRAWN_HEADS:
        raise ValueError(f"query_heads: the figure draws at most {MAX_KV_DRAWN_HEADS} query "
                         f"heads (got {cfg.query_heads})")
    return cfg


def _caption(cfg: Config) -> tuple[str, str]:
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


def _png(renders: Renders, cfg: Config, palette=False,
         standing: StandingFigure | None = None) -> bytes:
    """The replica-groups PNG; live (``standing`` given) drawn in a standing frame per number
    of query heads, whose boxes, groups, legend and title are redrawn."""
    draw = None if standing is None else (
        lambda: standing.pixels(("replica_groups", cfg.query_heads), cfg))
    return renders.png(("kv", cfg), lambda: replica_groups_figure(cfg), palette, draw)


def replica_groups_standing_figure() -> StandingFigure:
    """``replica_groups_figure`` kept standing: one frame, reshaped for another number of
    query heads."""
    return PastingStandingFigure(  # the background is the frame: its layer is all dynamic
        build=lambda structure, _cfg: replica_groups_frame(structure[1]),
        update=set_replica_groups, dynamic=layout_dynamic_artists, **HEADS_FRAME_FAMILIES)


def kv_explorer(query_heads: int = 8, kv_heads: int = 2, world_size: int = 4,
                kv_strategy: str = "replicate_weights") -> Explorer:
    """Which rank reads which KV head, the replica groups, and what each strategy moves; an
    invalid layout shows ``Config``'s own message."""
    controls = config_controls(query_heads=query_heads, kv_heads=kv_heads, world_size=world_size)
    controls["kv_strategy"] = widgets.ToggleButtons(options=list(KV_STRATEGIES), value=kv_strategy,
                                                    description="strategy",
                                                    style={"button_width": "auto"})
    renders, standing = Renders(), replica_groups_standing_figure()

    @functools.lru_cache(maxsize=32)  # a layout shown again: its outputs, not a new PNG
    def shown(cfg: Config) -> tuple[dict, dict]:
        text, markup = _caption(cfg)
        return (html_output(markup, text),
                png_output(_png(renders, cfg, standing=standing),
                           f"<replica groups, {cfg.query_heads}/{cfg.kv_heads}/"
                           f"{cfg.world_size}, {cfg.kv_strategy}>"))

    def draw(query_heads, kv_heads, world_size, kv_strategy):
        return list(shown(kv_config(query_heads, kv_heads, world_size, kv_strategy)))

    explorer = Explorer("kv", controls, draw, static=lambda: static_kv_explorer(
        initial=((query_heads, kv_heads, world_size), kv_strategy), renders=renders,
        standing=standing))
    explorer.renders, explorer.standing, explorer.shown = renders, standing, shown
    return explorer


def static_kv_explorer(layouts=KV_LAYOUTS, initial=((8, 2, 4), "replicate_weights"),
                       renders: Renders | None = None,
                       standing: StandingFigure | None = None) -> StaticExplorer:
    """The live explorer's panels for each layout × strategy (an invalid one shows
    ``Config``'s message). ``standing``: draw them in the live explorer's standing frames
    (the same pixels, one build per number of query heads, which then stand for the live
    updates)."""
    layouts = [tuple(layout) for layout in layouts]
    renders = Renders() if renders is None else renders
    panels = {}
    for i, layout in enumerate(layouts):
        for j, strategy in enumerate(KV_STRATEGIES):
            try:
                cfg = kv_config(*layout, strategy)
            except ValueError as error:
                panels[(i, j)] = message_html(str(error))
                continue
            panels[(i, j)] = _caption(cfg)[1] + png_img(
                _png(renders, cfg, palette=True, standing=standing),
                "{} q / {} kv / {} ranks".format(*layout) + f", {strategy}")
    labels = ["{} q · {} kv · {} ranks".format(*layout) for layout in layouts]
    layout0, strategy0 = initial
    start = (layouts.index(tuple(layout0)) if tuple(layout0) in layouts else 0,
             KV_STRATEGIES.index(strategy0))
    return StaticExplorer("kv", [("layout", labels), ("strategy", list(KV_STRATEGIES))], panels,
                          initial=start)
