"""A standing figure whose labels and legends are drawn once per look, then pasted.

Used by the heads frames of the sharding (chapter 6) and kv (chapter 13) explorers, one
frame per kind reshaped from one number of query heads to another (``HEADS_FRAME_FAMILIES``).
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.legend import Legend
from matplotlib.text import Text

from ..viz.fast_text import draw_text
from ..viz.frames import reshape_heads_frame
from .core import StandingFigure

__all__ = ["PastingStandingFigure", "HEADS_FRAME_FAMILIES"]

#: ``StandingFigure`` arguments for structures ``(kind, query_heads)`` of heads frames: one
#: frame per kind, reshaped from one number of query heads to another.
HEADS_FRAME_FAMILIES = dict(family=lambda structure: structure[0],
                            reshape=lambda fig, structure: reshape_heads_frame(fig, structure[1]))


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
    """What a (frameless) legend's pixels depend on besides where it is anchored: its
    entries, fonts and placement around the anchor."""
    anchor = legend.get_bbox_to_anchor()
    return ("legend", legend.get_frame_on(), legend._loc, anchor.width, anchor.height,
            tuple(_text_look(t) for t in legend.texts),
            tuple((type(h).__name__, tuple(h.get_facecolor()), tuple(h.get_edgecolor()))
                  for h in legend.legend_handles))


def _whole_pixel(x: float, y: float) -> bool:
    return x == math.floor(x) and y == math.floor(y) and abs(x) < 2**20 and abs(y) < 2**20


def _look_and_anchor(artist, height: int) -> tuple[tuple | None, int, int]:
    """``(key, row, column)``: what the artist's pixels depend on (besides what lies under
    it), and the pixel its rectangle is relative to. A text or legend anchored on a whole
    pixel (see ``tpattn.viz.frames.WholePixels``) has the same pixels, shifted, at any
    whole pixel: its key leaves out where; a legend elsewhere has a key that holds its exact
    place on this canvas. A text elsewhere (a title: a new string with most layouts) is not
    pasted (key ``None``): ``viz.fast_text`` draws a string seen before as fast."""
    if isinstance(artist, Legend):
        look = _legend_look(artist)
        x, y = artist.get_bbox_to_anchor().p0
    elif isinstance(artist, Text):
        x, y = artist.get_transform().transform(artist.get_unitless_position())
        look = _text_look(artist) if _whole_pixel(x, y) else None
        if look is None:
            return None, 0, 0
    else:
        return None, 0, 0
    if _whole_pixel(x, y):
        return (look, "whole pixel"), height - int(y), int(x)
    return (look, x, y, height), 0, 0


class PastingStandingFigure(StandingFigure):
    """A ``StandingFigure`` whose labels and legends are drawn once per look and then pasted.

    Rasterizing text is most of a heads frame's update (~1 ms a label, ~10 ms a legend on a
    small machine), and most labels look the same from one layout to the next: ``q3`` on
    rank 1's color. Where an artist's pixel rectangle (its extent, 2 px wider) holds one
    color before it is drawn, its pixels there are a function of that color, of the artist's
    look (text, font, color, alignment) and of where it is anchored — for a label anchored
    on a whole pixel, of nothing else: it is pasted at any whole pixel, in any standing
    frame. The first draw of each (look, color) is kept and pasted after; it also checks that
    the artist changed nothing outside its rectangle (else it is always drawn). The pixels
    are those of drawing it (``tests/test_widgets.py`` compares them with a fresh figure's).
    Texts it draws (not pasted) go through ``tpattn.viz.fast_text``; a legend anchored on a
    whole pixel is pasted anywhere, like a label.
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
                self._draw(fig, artist)
                continue
            if key not in self.kept:
                self.kept[key] = self._rectangle(artist, canvas, height, row, column)
                while len(self.kept) > self.MAX_LOOKS:
                    del self.kept[next(iter(self.kept))]
            entry = self.kept[key]
            if entry is None:  # drew outside its rectangle once
                self._draw(fig, artist)
                continue
            (top, bottom, left, right), looks = entry
            top, bottom, left, right = top + row, bottom + row, left + column, right + column
            margin = self.RING
            if (top < margin or left < margin or bottom > height - margin
                    or right > width - margin):  # near the edge: no ring to check
                self._draw(fig, artist)
                continue
            under = pixels[top:bottom, left:right]
            color = under[0, 0].tobytes()
            if not (under == under[0, 0]).all():  # not one color under it: draw it
                self._draw(fig, artist)
            elif color in looks:
                under[...] = looks[color]
            else:
                ring = (slice(top - margin, bottom + margin), slice(left - margin, right + margin))
                before = pixels[ring].copy()
                self._draw(fig, artist)
                changed = (pixels[ring] != before).any(axis=-1)
                changed[margin:-margin, margin:-margin] = False
                if changed.any():
                    self.kept[key] = None
                else:
                    looks[color] = under.copy()

    @staticmethod
    def _draw(fig, artist) -> None:
        """Draw one artist; a text through ``tpattn.viz.fast_text`` (``Text.draw``'s pixels,
        from cached layouts and glyphs: a title seen once is laid out once)."""
        if isinstance(artist, Text):
            draw_text(artist, fig.canvas.get_renderer())
        else:
            fig.draw_artist(artist)

    def _rectangle(self, artist, canvas, height, row, column):
        """``((top, bottom, left, right), {})``: the artist's pixel rows and columns (its
        extent, ``PAD`` wider), relative to ``(row, column)``."""
        extent = artist.get_window_extent(canvas.get_renderer())
        top = height - math.ceil(extent.y1) - self.PAD - row
        bottom = height - math.floor(extent.y0) + self.PAD - row
        left = math.floor(extent.x0) - self.PAD - column
        right = math.ceil(extent.x1) + self.PAD - column
        return (top, bottom, left, right), {}
