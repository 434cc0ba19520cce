"""Chapter 13's explorer: query heads × KV heads × world size (× strategy) → the layout, the
replica groups, and what each ``kv_strategy`` holds and moves (live and static twins)."""
from __future__ import annotations

import functools
import html
import math

import ipywidgets as widgets
import numpy as np
from matplotlib.legend import Legend
from matplotlib.text import Text

from ..config import KV_STRATEGIES, Config
from ..kv_heads import GATHER_ACTIVATIONS, has_replicas, kv_costs, kv_head_of_rank, replica_groups
from ..viz.kv import replica_groups_figure, replica_groups_frame, set_replica_groups
from ..viz.sharding import layout_dynamic_artists
from .core import (Explorer, Renders, StandingFigure, config_controls, html_output, message_html,
                   png_img, png_output)
from .static import StaticExplorer

__all__ = ["KV_LAYOUTS", "kv_config", "kv_explorer", "static_kv_explorer",
           "PastingStandingFigure"]

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


def _text_look(artist: Text) -> tuple | None:
    """What a text's pixels depend on besides what lies under it and where it is anchored,
    or ``None`` for a text that may draw more than glyphs (a box, path effects, TeX)."""
    if artist.get_bbox_patch() is not None or artist.get_path_effects() or artist.get_usetex():
        return None
    font = artist.get_fontproperties()
    return ("text", artist.get_text(), tuple(font.get_family()), font.get_style(),
            font.get_variant(), font.get_weight(), font.get_stretch(), font.get_size_in_points(),
            font.get_file(), font.get_math_fontfamily(), str(artist.get_color()),
            artist.get_alpha(), artist.get_ha(), artist.get_va(), artist.get_rotation(),
            artist.get_rotation_mode(), artist._linespacing, artist._multialignment,
            artist.get_antialiased(), artist.get_wrap())


def _legend_look(legend: Legend) -> tuple:
    """What a (frameless) legend's pixels depend on: its entries, fonts and anchor."""
    return ("legend", legend.get_frame_on(), legend._loc,
            tuple(legend.get_bbox_to_anchor().bounds),
            tuple(_text_look(t) for t in legend.texts),
            tuple((type(h).__name__, tuple(h.get_facecolor()), tuple(h.get_edgecolor()))
                  for h in legend.legend_handles))


def _look_and_anchor(artist, height: int) -> tuple[tuple | None, int, int]:
    """``(key, row, column)``: what the artist's pixels depend on (besides what lies under
    it), and the pixel its rectangle is relative to. A text anchored on a whole pixel (see
    ``tpattn.viz.sharding.WholePixels``) has the same pixels, shifted, at any whole pixel: its
    key leaves out where; any other artist's key holds its exact place on this canvas."""
    if isinstance(artist, Legend):
        return (_legend_look(artist), height), 0, 0
    look = _text_look(artist) if isinstance(artist, Text) else None
    if look is None:
        return None, 0, 0
    x, y = artist.get_transform().transform(artist.get_unitless_position())
    if x == math.floor(x) and y == math.floor(y) and abs(x) < 2**20 and abs(y) < 2**20:
        return (look, "whole pixel"), height - int(y), int(x)
    return (look, x, y, height), 0, 0


class PastingStandingFigure(StandingFigure):
    """A ``StandingFigure`` whose texts and legends are drawn once per look and then pasted.

    Rasterizing text is most of a heads frame's update (~1 ms a label, ~10 ms a legend on a
    small machine), and most labels look the same from one layout to the next: ``q3`` on
    rank 1's color. Where an artist's pixel rectangle (its extent, 2 px wider) holds one
    color before it is drawn, its pixels there are a function of that color, of the artist's
    look (text, font, color, alignment) and of where it is anchored — for a label anchored
    on a whole pixel, of nothing else: it is pasted at any whole pixel, in any standing
    frame. The first draw of each (look, color) is kept and pasted after; it also checks that
    the artist changed nothing outside its rectangle (else it is always drawn). The pixels
    are those of drawing it (``tests/test_widgets.py`` compares them with a fresh figure's).
    """

    PAD, RING = 2, 4  # px around an artist's extent: its rectangle, then the checked ring
    #: Looks kept at most (the oldest go first): a few MB of small pixel blocks.
    MAX_LOOKS = 1024

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept: dict = {}  # key -> (rectangle relative to the anchor, {color: pixels})

    def draw_dynamic(self, fig) -> None:
        canvas = fig.canvas
        pixels = np.asarray(canvas.buffer_rgba())  # the canvas itself (a view)
        height, width = pixels.shape[:2]
        for artist in self._dynamic(fig):
            if not artist.get_visible():
                continue
            key, row, column = _look_and_anchor(artist, height)
            if key is None:
                fig.draw_artist(artist)
                continue
            if key not in self.kept:
                self.kept[key] = self._rectangle(artist, canvas, height, row, column)
                while len(self.kept) > self.MAX_LOOKS:
                    del self.kept[next(iter(self.kept))]
            entry = self.kept[key]
            if entry is None:  # drew outside its rectangle once
                fig.draw_artist(artist)
                continue
            (top, bottom, left, right), looks = entry
            top, bottom, left, right = top + row, bottom + row, left + column, right + column
            margin = self.RING
            if (top < margin or left < margin or bottom > height - margin
                    or right > width - margin):  # near the edge: no ring to check
                fig.draw_artist(artist)
                continue
            under = pixels[top:bottom, left:right]
            color = under[0, 0].tobytes()
            if not (under == under[0, 0]).all():  # not one color under it: draw it
                fig.draw_artist(artist)
            elif color in looks:
                under[...] = looks[color]
            else:
                ring = (slice(top - margin, bottom + margin), slice(left - margin, right + margin))
                before = pixels[ring].copy()
                fig.draw_artist(artist)
                changed = (pixels[ring] != before).any(axis=-1)
                changed[margin:-margin, margin:-margin] = False
                if changed.any():
                    self.kept[key] = None
                else:
                    looks[color] = under.copy()

    def _rectangle(self, artist, canvas, height, row, column):
        """``((top, bottom, left, right), {})``: the artist's pixel rows and columns (its
        extent, ``PAD`` wider), relative to ``(row, column)``."""
        extent = artist.get_window_extent(canvas.get_renderer())
        top = height - math.ceil(extent.y1) - self.PAD - row
        bottom = height - math.floor(extent.y0) + self.PAD - row
        left = math.floor(extent.x0) - self.PAD - column
        right = math.ceil(extent.x1) + self.PAD - column
        return (top, bottom, left, right), {}


def replica_groups_standing_figure() -> StandingFigure:
    """``replica_groups_figure`` kept standing per number of query heads."""
    return PastingStandingFigure(  # the background is the frame: its layer is all dynamic
        build=lambda structure, _cfg: replica_groups_frame(structure[1]),
        update=set_replica_groups, dynamic=layout_dynamic_artists)


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
