"""Text redrawn fast on an Agg canvas, pixel for pixel as ``Text.draw`` draws it (live explorers).

A live explorer redraws the same texts on every update (the attention explorer: 60 cell values
and a title), and ``Text.draw`` redoes all of its work each time: it lays the string out, finds
its font, renders every glyph with FreeType and blends it in (~1 ms a text on a small machine).
``draw_text(text, renderer)`` does the same steps in the same order with the same calls, but
keeps what does not change from one draw to the next:

- the layout of a string (``Text._get_layout``'s offsets and the font's glyph list), by string,
  font properties, alignment and dpi;
- each glyph's bitmap, by font, size, glyph and the *fraction of a pixel* of its position:
  FreeType renders an outline moved by whole pixels to the same bitmap, moved by those pixels,
  so a glyph rendered once serves every position with the same fraction.

The bitmaps are blended by Agg's own ``draw_text_image`` with the text's own graphics context,
so the pixels are those of ``Text.draw`` (``tests/test_widgets.py`` compares them over many
strings, positions and colors). A text outside the cached case — rotated, math or TeX,
several lines, wrapped, boxed, with path effects, not antialiased, not on an Agg renderer, or a
matplotlib without the private calls used here — is drawn by ``Text.draw`` itself.

``FastDrawn(artist)`` wraps a ``Text`` for the lists of artists a ``StandingFigure`` redraws
(its ``draw`` is ``draw_text``; visibility is the text's own).
"""
from __future__ import annotations

import math

import matplotlib as mpl
import matplotlib.colors as mcolors
import numpy as np
from matplotlib.backends.backend_agg import RendererAgg, get_hinting_flag
from matplotlib.text import Text

try:  # the private calls of matplotlib 3.11's RendererAgg.draw_text
    from matplotlib.ft2font import FT2Font, RenderMode

    _SUPPORTED = all(hasattr(FT2Font, name) for name in ("_layout", "_set_transform",
                                                         "_render_glyph")) and all(
        hasattr(RendererAgg, name) for name in ("_prepare_font", "_draw_text_glyphs_and_boxes"))
except ImportError:  # pragma: no cover - another matplotlib
    _SUPPORTED = False

__all__ = ["draw_text", "draw_texts", "warm", "FastDrawn", "FastDrawnGroup", "cache_sizes",
           "clear_caches"]

#: Most entries kept per cache (then it starts afresh): a live explorer needs a few hundred.
MAX_ENTRIES = 20_000
_IDENTITY = np.array([[0x10000, 0], [0, 0x10000]])

_layouts: dict = {}  # layout key -> [offset x, offset y, ((font, size, glyph, dx, dy), ...), runs]
_glyphs: dict = {}  # (font, size, dpi, glyph, fraction x, y, flags) -> (bitmap, left, top)


def cache_sizes() -> dict[str, int]:
    """How many layouts and glyph bitmaps are cached."""
    return {"layouts": len(_layouts), "glyphs": len(_glyphs)}


def clear_caches() -> None:
    """Forget every cached layout and glyph."""
    _layouts.clear()
    _glyphs.clear()


def _cacheable(text: Text, renderer) -> bool:
    return (_SUPPORTED and type(text) is Text and isinstance(renderer, RendererAgg)
            and text.get_rotation() == 0 and not text.get_transform_rotates_text()
            and not text.get_usetex() and not text.get_wrap() and text._bbox_patch is None
            and not text.get_path_effects() and text._antialiased
            and "\n" not in text.get_text())


def _layout(text: Text, renderer, line: str):
    """``[offset x, offset y, glyphs, runs]`` of ``text`` drawn as ``Text.draw`` would (``runs``:
    its merged bitmaps by glyph positions, filled by ``_run``), or ``None`` where the cached
    path does not apply (math)."""
    prop = text.get_fontproperties()
    dpi = text.get_figure(root=True).dpi
    features, language = text.get_fontfeatures(), text.get_language()
    key = (line, hash(prop), dpi, renderer.dpi, text.get_horizontalalignment(),  # hash: as
           text.get_verticalalignment(), text.get_rotation_mode(), text._linespacing,  # prop ==
           text._get_multialignment(), text.get_parse_math(),
           None if features is None else tuple(features), language, get_hinting_flag(),
           mpl.rcParams["text.hinting_factor"])
    entry = _layouts.get(key)
    if entry is None:
        _, info, _ = text._get_layout(renderer)
        if len(info) != 1:
            return None
        (drawn, _, (offset_x, offset_y)), = info
        clean, ismath = text._preprocess_math(drawn)
        if ismath or not clean:
            entry = False
        else:
            font = renderer._prepare_font(prop)  # as RendererAgg.draw_text
            items = font._layout(clean, flags=get_hinting_flag(), features=features,
                                 language=language)
            size = prop.get_size_in_points()
            entry = [offset_x, offset_y, tuple((item.ft_object, size, item.glyph_index,
                                                item.x, item.y) for item in items), {}]
        if len(_layouts) >= MAX_ENTRIES:
            _layouts.clear()
        _layouts[key] = entry
    return entry or None


def _glyph(font, size, dpi, glyph_index, x64: int, y64: int, flags):
    """Bitmap, left and top of a glyph at ``(x64, y64)`` (1/64 pixel), from the cache."""
    whole_x, fraction_x = divmod(x64, 64)
    whole_y, fraction_y = divmod(y64, 64)
    key = (font, size, dpi, glyph_index, fraction_x, fraction_y, flags)
    entry = _glyphs.get(key)
    if entry is None:
        font.set_size(size, dpi)
        font._set_transform(_IDENTITY, [fraction_x, fraction_y])
        bitmap = font._render_glyph(glyph_index, flags, RenderMode.NORMAL)
        entry = (bitmap.buffer, bitmap.left, bitmap.top)
        if len(_glyphs) >= MAX_ENTRIES:
            _glyphs.clear()
        _glyphs[key] = entry
    buffer, left, top = entry
    return buffer, left + whole_x, top + whole_y


def _merged(bitmaps):
    """One bitmap ``(buffer, left, top)`` holding ``bitmaps``, or ``None`` if two of them
    cover a pixel (blended one after the other, such a pixel is not their merge). Blending
    a pixel of coverage 0 leaves it as it was, so a merged bitmap whose glyphs do not
    overlap blends to the pixels of blending each glyph."""
    left = min(b[1] for b in bitmaps)
    top = max(b[2] for b in bitmaps)
    width = max(b[1] + b[0].shape[1] for b in bitmaps) - left
    rows = max(b[0].shape[0] - b[2] for b in bitmaps) + top
    merged = np.zeros((rows, width), dtype=np.uint8)
    apart = _disjoint([(b[1], -b[2], b[1] + b[0].shape[1], -b[2] + b[0].shape[0])
                       for b in bitmaps])
    for buffer, glyph_left, glyph_top in bitmaps:
        region = merged[top - glyph_top:top - glyph_top + buffer.shape[0],
                        glyph_left - left:glyph_left - left + buffer.shape[1]]
        if apart:  # boxes apart: nothing to check
            region[...] = buffer
            continue
        if np.any(region[buffer > 0]):
            return None
        region[...] = np.maximum(region, buffer)
    return merged, left, top


def _run(entry, x: float, y: float, height: float, dpi, flags):
    """The bitmaps to blend for ``entry``'s glyphs with the text at ``(x, y)`` (y down): one
    merged bitmap where its glyphs do not overlap, else one per glyph."""
    glyphs, runs = entry[2], entry[3]
    positions = [(round(0x40 * (x + dx)), round(0x40 * (height - y + dy)))
                 for _, _, _, dx, dy in glyphs]  # RendererAgg's 26.6 positions at angle 0
    base_x, base_y = positions[0][0] // 64, positions[0][1] // 64
    key = tuple((px - 64 * base_x, py - 64 * base_y) for px, py in positions)
    run = runs.get(key)
    if run is None:
        bitmaps = [_glyph(font, size, dpi, glyph_index, px, py, flags)
                   for (font, size, glyph_index, _, _), (px, py) in zip(glyphs, positions)]
        merged = _merged(bitmaps)
        run = [merged] if merged is not None else bitmaps
        run = [(buffer, left - base_x, top - base_y) for buffer, left, top in run]
        if len(runs) >= MAX_ENTRIES:
            runs.clear()
        runs[key] = run
    return [(buffer, left + base_x, top + base_y) for buffer, left, top in run]


_SKIP = "skip"  # _plans: a text that draws nothing (hidden or empty)


def _positions(texts, renderer) -> list:
    """Display position (x, y up) of each text, as ``Text.draw`` computes it, or ``None`` for
    a text it would not draw (not finite). Texts sharing a transform are transformed in one
    call (the same affine arithmetic, point by point)."""
    by_transform: dict = {}
    for i, text in enumerate(texts):
        point = (float(text.convert_xunits(text._x)), float(text.convert_yunits(text._y)))
        by_transform.setdefault(id(text.get_transform()), (text.get_transform(), [], []))
        _, indices, points = by_transform[id(text.get_transform())]
        indices.append(i)
        points.append(point)
    out = [None] * len(texts)
    for transform, indices, points in by_transform.values():
        for i, (posx, posy) in zip(indices, transform.transform(np.array(points)).tolist()):
            if math.isfinite(posx) and math.isfinite(posy):
                out[i] = (posx, posy)
    return out


def _plans(texts, renderer) -> list:
    """For each text, what ``Text.draw`` would blend: ``(gc key, bitmaps)`` (``bitmaps``:
    ``(buffer, left, top)`` in order), ``_SKIP`` if it draws nothing, or ``None`` if it is not
    the cached case (``text.draw`` must draw it)."""
    plans: list = [None] * len(texts)
    todo = []
    for i, text in enumerate(texts):
        if not _cacheable(text, renderer):
            continue
        text._renderer = renderer
        if not text.get_visible() or text.get_text() == "":
            plans[i] = _SKIP
            continue
        entry = _layout(text, renderer, text.get_text())
        if (entry is None or np.ma.is_masked(text._x) or np.ma.is_masked(text._y)
                or text._clippath is not None):
            continue
        todo.append((i, text, entry))
    positions = _positions([text for _, text, _ in todo], renderer)
    flags, height, dpi = get_hinting_flag(), renderer.height, renderer.dpi
    flip = renderer.get_canvas_width_height()[1] if renderer.flipy() else None
    for (i, text, entry), position in zip(todo, positions):
        if position is None:
            continue  # Text.draw: its own warning, or nothing
        clip = text.clipbox if text._clipon else None
        key = (mcolors.to_rgba(text.get_color()), text.get_alpha(), text._url,
               text._antialiased, text.get_snap(), text._clipon,
               None if clip is None else tuple(clip.bounds))
        # RendererAgg._draw_text_glyphs_and_boxes at angle 0, its bitmaps from the caches
        x, y = entry[0] + position[0], entry[1] + position[1]  # Text.draw's order
        plans[i] = key, _run(entry, x, y if flip is None else flip - y, height, dpi, flags)
    return plans


def _graphics_context(text: Text, renderer, key):
    """``Text.draw``'s graphics context for ``text`` (``key``: its settings, from ``_plans``)."""
    gc = renderer.new_gc()
    gc.set_foreground(key[0], isRGBA=True)
    gc.set_alpha(text.get_alpha())
    gc.set_url(text._url)
    gc.set_antialiased(text._antialiased)
    gc.set_snap(text.get_snap())
    text._set_gc_clip(gc)
    return gc


def _blend(renderer, gc, bitmaps) -> None:
    height = int(renderer.height)
    for buffer, left, top in bitmaps:
        renderer._renderer.draw_text_image(buffer, left, height - top + buffer.shape[0], 0, gc)


def draw_text(text: Text, renderer) -> None:
    """``text.draw(renderer)``, with its layout and glyphs from the caches where it can."""
    draw_texts([text], renderer)


def draw_texts(texts, renderer) -> None:
    """``text.draw(renderer)`` for each of ``texts`` in order (consecutive in z order: nothing
    drawn between them). Where all are the cached case and no two of their bitmaps share a
    pixel, the order does not matter — every pixel is blended by one glyph at most — and the
    texts of one graphics context (color, alpha, clip) are blended as one bitmap, in one
    call; else one after the other, as ``Text.draw``."""
    texts = list(texts)
    plans = _plans(texts, renderer)
    drawn = [(text, plan) for text, plan in zip(texts, plans) if plan is not _SKIP]
    groups = None
    if len(drawn) > 1 and all(plan is not None for _, plan in drawn):
        groups = _merge_by_key(drawn)
    if groups is not None:
        for text, key, bitmap in groups:
            gc = _graphics_context(text, renderer, key)
            _blend(renderer, gc, [bitmap])
            gc.restore()
    else:
        for text, plan in drawn:
            if plan is None:
                text.draw(renderer)
                continue
            gc = _graphics_context(text, renderer, plan[0])
            _blend(renderer, gc, plan[1])
            gc.restore()
    for text, plan in drawn:
        if plan is not None:
            text.stale = False


def _disjoint(boxes) -> bool:
    """Whether no two of ``boxes`` (left, top, right, bottom; rows down) intersect."""
    boxes = sorted(boxes)
    reach = []  # boxes still open along x (sweep by left edge)
    for box in boxes:
        reach = [b for b in reach if b[2] > box[0]]
        if any(b[1] < box[3] and box[1] < b[3] for b in reach):
            return False
        reach.append(box)
    return True


def _merge_by_key(drawn):
    """``[(a text, its gc key, merged bitmap)]``, one per graphics-context key, or ``None``
    if two bitmaps may share a pixel (their boxes intersect)."""
    boxes, groups = [], {}
    for text, (key, bitmaps) in drawn:
        group = groups.setdefault(key, (text, []))[1]
        for buffer, left, top in bitmaps:  # top: FreeType's, up; rows counted down from it
            boxes.append((left, -top, left + buffer.shape[1], -top + buffer.shape[0]))
            group.append((buffer, left, top))
    if not _disjoint(boxes):
        return None
    out = []
    for key, (text, bitmaps) in groups.items():
        left = min(b[1] for b in bitmaps)
        top = max(b[2] for b in bitmaps)
        width = max(b[1] + b[0].shape[1] for b in bitmaps) - left
        rows = max(b[0].shape[0] - b[2] for b in bitmaps) + top
        merged = np.zeros((rows, width), dtype=np.uint8)
        for buffer, glyph_left, glyph_top in bitmaps:
            merged[top - glyph_top:top - glyph_top + buffer.shape[0],
                   glyph_left - left:glyph_left - left + buffer.shape[1]] = buffer
        out.append((text, key, (merged, left, top)))
    return out


class FastDrawn:
    """``artist`` (a ``Text``) for a ``StandingFigure``'s list of redrawn artists: drawn by
    ``draw_text``; ``get_visible``/``set_visible`` are the text's own."""

    def __init__(self, artist: Text):
        self.artist = artist

    def get_visible(self) -> bool:
        return self.artist.get_visible()

    def set_visible(self, visible: bool) -> None:
        self.artist.set_visible(visible)

    def draw(self, renderer) -> None:
        draw_text(self.artist, renderer)

    def __repr__(self) -> str:
        return f"FastDrawn({self.artist!r})"


class FastDrawnGroup:
    """``texts`` (consecutive in z order) as one entry of a ``StandingFigure``'s list of
    redrawn artists: drawn by ``draw_texts``. Hidden and shown again (as ``StandingFigure``
    does around its background), each text gets back its own visibility."""

    def __init__(self, texts):
        self.texts = list(texts)
        self._visible: list[bool] | None = None

    def get_visible(self) -> bool:
        return any(text.get_visible() for text in self.texts)

    def set_visible(self, visible: bool) -> None:
        if not visible:
            if self._visible is None:
                self._visible = [text.get_visible() for text in self.texts]
            for text in self.texts:
                text.set_visible(False)
        else:
            before, self._visible = self._visible, None
            for text, was in zip(self.texts, before or [True] * len(self.texts)):
                text.set_visible(was)

    def draw(self, renderer) -> None:
        draw_texts(self.texts, renderer)

    def __repr__(self) -> str:
        return f"FastDrawnGroup({len(self.texts)} texts)"


def warm(texts, strings, renderer) -> None:
    """Render into the cache the glyphs that ``texts`` would blend showing each of ``strings``
    at their positions (and those strings' layouts), drawing nothing; each text keeps its own
    string. For a live explorer whose labels take a known set of strings (cell values to two
    decimals): done while its cell runs, it spares the reader's first updates ~1000 glyph
    renders. Texts outside the cached case are left out."""
    texts = [text for text in texts if _cacheable(text, renderer)]
    positions = _positions(texts, renderer)
    flags, height, dpi = get_hinting_flag(), renderer.height, renderer.dpi
    flip = renderer.get_canvas_width_height()[1] if renderer.flipy() else None
    for text, position in zip(texts, positions):
        own = text.get_text()
        try:
            for string in strings:
                text.set_text(string)
                entry = _layout(text, renderer, string) if position is not None else None
                if entry is None:
                    continue
                x, y = entry[0] + position[0], entry[1] + position[1]  # as _plans
                y = y if flip is None else flip - y
                for font, size, glyph_index, dx, dy in entry[2]:
                    _glyph(font, size, dpi, glyph_index, round(0x40 * (x + dx)),
                           round(0x40 * (height - y + dy)), flags)
        finally:
            text.set_text(own)
