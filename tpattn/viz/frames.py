"""Heads frames: the standing figure of heads, boxes, lines and a rank legend that the
sharding (chapter 6, ``tpattn.viz.sharding.set_heads_layout``) and kv (chapter 13,
``tpattn.viz.kv.set_replica_groups``) figures draw their layouts in.

A frame (``new_heads_frame``) has fixed margins and limits, so a live explorer can keep it and
redraw only a layout's artists; ``reshape_heads_frame`` makes it the frame of another number
of query heads. A layout keeps its artists between draws (``_kept``: labels, one collection of
lines, one of boxes, a legend per number of ranks) and sets only what changed.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import matplotlib as mpl
import matplotlib.patches as mpatches
import matplotlib.transforms as mtransforms
import numpy as np
from matplotlib.collections import LineCollection, PathCollection
from matplotlib.font_manager import FontProperties
from matplotlib.legend import Legend
from matplotlib.text import Text

from ..config import Config
from .style import new_figure, rank_color

__all__ = ["HEADS_MARGINS", "FrameGeometry", "new_heads_frame", "reshape_heads_frame",
           "clear_layer", "set_layer", "head_lines", "head_boxes", "head_label",
           "WholePixels", "pixel_label", "rank_legend", "two_line_title", "HEAD_BOX",
           "layout_dynamic_artists"]


#: Margins of the heads frames, in inches (left, bottom, right, top): the room constrained
#: layout gives them — the two-line title above the axes, the rank legend (up to two-digit
#: ranks) to their right. A fixed layout: the axes stay where they are whatever layout is
#: drawn in them (a standing figure's frame), and no layout engine runs for a new frame.
HEADS_MARGINS = (3 / 72, 3 / 72, 0.92, 0.44)


class FrameGeometry(NamedTuple):
    """What a heads frame of some number of query heads looks like: its size in inches, its
    two row labels (right-aligned at x = -0.9, at ``label_ys``) and its data limits."""

    width: float
    height: float
    labels: tuple[str, str]
    label_ys: tuple[float, float]
    xlim: tuple[float, float]
    ylim: tuple[float, float]


def new_heads_frame(query_heads: int, kind: str, geometry: Callable[[int], FrameGeometry]):
    """An empty frame of ``geometry(query_heads)``: the two row labels, fixed limits, no axis,
    margins ``HEADS_MARGINS`` (``_fit_frame``), and the ``tpattn_heads`` record (``kind``,
    ``geometry``, ``query_heads``, the ``layer`` drawn in it)."""
    shape = geometry(query_heads)
    fig, ax = new_figure(figsize=(shape.width, shape.height), layout=None)
    rows = [ax.text(-0.9, y, label, ha="right", va="center", fontsize=9)
            for label, y in zip(shape.labels, shape.label_ys)]
    ax.set_aspect("auto")
    ax.axis("off")
    fig.tpattn_heads = {"kind": kind, "geometry": geometry, "rows": rows, "layer": [],
                        "previous": []}
    _fit_frame(fig, query_heads)
    return fig


def _fit_frame(fig, query_heads: int) -> None:
    """Give a heads frame the size, limits and margins of ``query_heads``
    (``HEADS_MARGINS``, the left one widened if a row label would reach past the figure's
    edge)."""
    frame, ax = fig.tpattn_heads, fig.axes[0]
    shape = frame["geometry"](query_heads)
    width, height, xlim = shape.width, shape.height, shape.xlim
    fig.set_size_inches(width, height)
    ax.set_xlim(*xlim)
    ax.set_ylim(*shape.ylim)
    left, bottom, right, top = HEADS_MARGINS
    span, room = xlim[1] - xlim[0], -0.9 - xlim[0]  # data units: all, left of the labels
    widest = _widest_row_label(fig)
    inches = width - left - right  # the axes' width if the labels fit
    if widest > room * inches / span:  # they do not: move the axes right until they do
        left += (widest * span - room * inches) / (span - room)
    ax.set_position([left / width, bottom / height, 1 - (left + right) / width,
                     1 - (bottom + top) / height])
    frame["query_heads"] = query_heads


def _widest_row_label(fig) -> float:
    """The width of a heads frame's widest row label, in inches (measured once per dpi)."""
    frame, dpi = fig.tpattn_heads, fig.dpi
    widths = frame.setdefault("widest", {})
    if dpi not in widths:
        renderer = fig.canvas.get_renderer()
        widths[dpi] = max(t.get_window_extent(renderer).width for t in frame["rows"]) / dpi
    return widths[dpi]


def reshape_heads_frame(fig, query_heads: int) -> None:
    """Make a heads frame (``heads_frame``, ``replica_groups_frame``) of any number of query
    heads the empty frame of ``query_heads`` — the same size, limits, margins and pixels as a
    new one — keeping its figure, axes and the artists its layouts keep (``_kept``), e.g. for
    a standing figure (building a frame costs ~0.1 s on a small machine)."""
    frame = fig.tpattn_heads
    _take_away(frame["previous"] + frame["layer"])
    frame["previous"], frame["layer"] = [], []
    fig.axes[0].title.set_text("")
    _fit_frame(fig, query_heads)


def _take_away(artists) -> None:
    """Take layer artists out of a heads frame (kept ones hidden, for a next layout: ``_kept``)."""
    for artist in artists:
        if getattr(artist, "tpattn_kept", False):
            artist.set_visible(False)
        else:
            artist.remove()


def clear_layer(fig, cfg: Config):
    """The axes of a heads frame (``new_heads_frame``) of ``cfg.query_heads``, ready for a new
    layer (``ValueError`` for a frame of another head count): the layer drawn there before
    goes when the new one is set (``set_layer``), but for the artists both keep."""
    frame = fig.tpattn_heads
    if frame["query_heads"] != cfg.query_heads:
        raise ValueError(f"query_heads: this frame is for {frame['query_heads']} query heads "
                         f"(got {cfg.query_heads})")
    frame["previous"], frame["layer"] = frame["previous"] + frame["layer"], []
    return fig.axes[0]


def set_layer(frame, layer: list) -> None:
    """Make ``layer`` what is drawn in a heads frame: artists of the layer before that it
    does not reuse are hidden (kept) or removed. (A kept artist in both is left visible:
    each visibility change marks the figure stale, a chain of callbacks.)"""
    reused = set(layer)
    _take_away([a for a in frame["previous"] if a not in reused])
    frame["previous"], frame["layer"] = [], layer


def _kept(frame, role: str, key, make: Callable):
    """The artist of ``role`` and ``key`` (an index, a count) in a heads frame, made (and
    added to the axes) by ``make()`` the first time: the next layout sets its properties
    again (~4x cheaper than adding new artists). A layout sets every property it depends on."""
    kept = frame.setdefault("kept", {}).setdefault(role, {})
    artist = kept.get(key)
    if artist is None:
        artist = kept[key] = make()
        artist.tpattn_kept = True
    if not artist.get_visible():
        artist.set_visible(True)
    return artist


def _update(artist, what: str, values: tuple, apply: Callable) -> None:
    """``apply()`` unless ``values`` are those ``what`` of ``artist`` (a kept one) was last
    set to: a property set marks the figure stale (a chain of callbacks) and may make the
    artist recompute what it draws."""
    record = artist.__dict__.setdefault("tpattn_set", {})
    if record.get(what) != values:
        apply()
        record[what] = values


def head_lines(ax, frame, lines) -> LineCollection:
    """The lines from query heads to the KV boxes they read, under the boxes: one kept
    collection (one artist to draw, not one per head). ``lines``: ``(xs, ys, color,
    linestyle, linewidth)`` per line."""
    collection = _kept(frame, "lines", 0, lambda: ax.add_collection(
        LineCollection([], zorder=1), autolim=False))
    segments = [list(zip(xs, ys)) for xs, ys, *_ in lines]
    styles = [tuple(line[2:]) for line in lines]
    _update(collection, "segments", segments, lambda: collection.set_segments(segments))
    _update(collection, "styles", styles, lambda: collection.set(
        color=[c for c, _, _ in styles], linestyle=[ls for _, ls, _ in styles],
        linewidth=[lw for _, _, lw in styles]))
    return collection


class WholePixels(mtransforms.Transform):
    """Rounds display coordinates to whole pixels. A label anchored through it
    (``ax.transData + WholePixels()``) has the same pixels wherever it is drawn, shifted by
    whole pixels (what ``tpattn.widgets.pasting.PastingStandingFigure`` pastes); it moves by less
    than half a pixel."""

    input_dims = output_dims = 2

    def transform_non_affine(self, values):
        return np.round(np.asarray(values, dtype=float))


def pixel_label(ax, text: str = "", **style):
    """``ax.text`` at ``(0, 0)`` in data coordinates rounded to whole pixels."""
    return ax.text(0, 0, text, transform=ax.transData + WholePixels(), **style)


def rank_legend(ax, frame, ranks: int) -> Legend:
    """The legend of the colors of ranks ``0 … ranks - 1``, right of the axes, its anchor
    rounded to a whole pixel (``WholePixels``: the same pixels, shifted, in any frame — what
    ``tpattn.widgets.pasting.PastingStandingFigure`` pastes); kept per number of ranks and
    made the axes' legend."""
    def make():
        handles = [mpatches.Patch(color=rank_color(r), label=f"rank {r}") for r in range(ranks)]
        return Legend(ax, handles, [h.get_label() for h in handles], loc="upper left",
                      bbox_to_anchor=(1.0, 1.0), bbox_transform=ax.transAxes + WholePixels(),
                      frameon=False, fontsize=8)

    ax.legend_ = _kept(frame, "legend", ranks, make)
    return ax.legend_


def two_line_title(ax, frame, first: str, second: str, color: str = "black") -> Text:
    """A two-line title as two texts: ``first`` is the axes' title, ``second`` (returned, one
    of few sentences: a live explorer redraws it from cached glyphs) a text below it, where
    the title's second line would be. The lines step by the title font's line height."""
    size = mpl.rcParams["axes.titlesize"]
    pad = mpl.rcParams["axes.titlepad"]
    step = 1.2 * FontProperties(size=size).get_size_in_points()  # points between baselines
    ax.set_title(first, color=color, pad=pad + step)
    line = _kept(frame, "title line 2", 0, lambda: ax.text(
        0.5, 1.0, "", ha="center", va="baseline", fontsize=size,
        transform=ax.transAxes + mtransforms.ScaledTranslation(0, pad / 72,
                                                               ax.figure.dpi_scale_trans)))
    line.set_text(second)
    line.set_color(color)
    return line


#: The style of a head's rounded box (``head_boxes``).
HEAD_BOX = mpatches.BoxStyle("round", pad=0.02)


def head_boxes(ax, frame, boxes) -> PathCollection:
    """Rounded boxes (white edges) under their labels: one kept collection. ``boxes``:
    ``(x, y, width, height, color)`` per box, centered at ``(x, y)``."""
    collection = _kept(frame, "boxes", 0, lambda: ax.add_collection(
        PathCollection([], edgecolor="white", zorder=2), autolim=False))
    paths = frame.setdefault("box paths", {})  # by center and size: a few per head count
    for x, y, width, height, _ in boxes:
        if (x, y, width, height) not in paths:
            paths[x, y, width, height] = HEAD_BOX(x - width / 2, y - height / 2, width,
                                                  height, 1.0)
    shapes = [box[:4] for box in boxes]
    _update(collection, "paths", shapes,
            lambda: collection.set_paths([paths[shape] for shape in shapes]))
    colors = [box[4] for box in boxes]
    _update(collection, "colors", colors, lambda: collection.set_facecolor(colors))
    return collection


def head_label(ax, frame, role: str, i: int, x: float, y: float, label: str,
                fontsize: float) -> Text:
    """The white bold ``label`` of the ``i``-th box of ``role``, centered at ``(x, y)``."""
    text = _kept(frame, role + " label", i, lambda: pixel_label(
        ax, ha="center", va="center", color="white", fontweight="bold", zorder=3))
    _update(text, "position", (x, y), lambda: text.set_position((x, y)))
    _update(text, "text", (label, fontsize),
            lambda: (text.set_text(label), text.set_fontsize(fontsize)))
    return text


def layout_dynamic_artists(fig) -> list:
    """What ``set_heads_layout`` / ``set_replica_groups`` drew, with the title, in the order
    the axes draw them (by zorder, then insertion; the title after its zorder's children)."""
    ax = fig.axes[0]
    layer = fig.tpattn_heads["layer"]
    legends = [a for a in layer if a is ax.legend_]
    children = [a for a in layer if a is not ax.legend_]
    return sorted([*children, ax.title, *legends], key=lambda a: a.get_zorder())
