"""Explorer machinery: controls, an output area that never shows a traceback, PNGs. Outputs
are assigned to ``Output.outputs``, never written ``with output:``: nothing leaks into a cell.
The static twin (``StaticExplorer``): precomputed panels behind radio buttons that select one
through CSS alone (no JavaScript); where ``<style>`` is stripped, every panel shows, captioned."""
from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import io
import itertools
import re
import struct
import sys
import zlib
from typing import Callable, Mapping, Sequence

import ipywidgets as widgets
import numpy as np
import torch
from PIL import Image

from tpattn.check.core import EQUIVALENCE, MODES
from tpattn.config import Config

__all__ = ["Explorer", "seed_control", "mode_control", "config_controls", "drawn_config",
           "encode_png", "StandingFigure", "png_output", "html_output", "text_output",
           "message_output", "png_img", "outputs_html", "single_thread", "StaticExplorer",
           "control_states"]


def _close(fig) -> None:  # matplotlib loads only where a figure is drawn
    import matplotlib.pyplot as plt
    plt.close(fig)


def _open_figures() -> set[int]:
    pyplot = sys.modules.get("matplotlib.pyplot")
    return set(pyplot.get_fignums()) if pyplot is not None else set()


#: Resolution of every PNG an explorer shows.
PNG_DPI = 100
#: Longest message shown in an output area.
MAX_MESSAGE = 400


def seed_control(value: int = 11, description: str = "seed") -> widgets.IntText:
    """A seed box: any integer (``run`` rejects the invalid ones)."""
    return widgets.IntText(value=value, description=description,
                           layout=widgets.Layout(width="11em"))


def mode_control(value: str = EQUIVALENCE, options=MODES) -> widgets.ToggleButtons:
    """The TP variant, one of ``options`` (default ``tpattn.MODES``)."""
    return widgets.ToggleButtons(options=list(options), value=value, description="mode",
                                 style={"button_width": "auto"})


def config_controls(**values: int) -> dict[str, widgets.IntText]:
    """One unbounded integer box per ``Config`` field of ``values`` (``Config`` says the rule)."""
    return {name: widgets.IntText(value=value, description=name, layout=widgets.Layout(
        width="10.5em"), style={"description_width": "initial"}) for name, value in values.items()}


def drawn_config(max_query_heads: int, **fields) -> Config:
    """``Config(**fields)``; ``ValueError`` above ``max_query_heads`` query heads."""
    cfg = Config(**fields)
    if cfg.query_heads > max_query_heads:
        raise ValueError(f"query_heads: the figure draws at most {max_query_heads} query heads "
                         f"(got {cfg.query_heads})")
    return cfg


def encode_png(pixels, palette: bool = False) -> bytes:
    """PNG bytes of an ``[H, W, 3|4]`` uint8 array as RGB: rows unfiltered, zlib level 1 (~3x
    faster than PIL for live updates); ``palette=True``: 256 colors, ~3x smaller."""
    rgb = np.ascontiguousarray(np.asarray(pixels)[..., :3])
    if palette:
        buf = io.BytesIO()
        Image.fromarray(rgb).quantize(256, method=Image.Quantize.FASTOCTREE).save(
            buf, format="png", compress_level=6)
        return buf.getvalue()
    height, width = rgb.shape[:2]
    rows = np.zeros((height, 1 + 3 * width), np.uint8)  # each row: filter type 0, then RGB
    rows[:, 1:] = rgb.reshape(height, -1)
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 1)) + chunk(b"IEND", b""))


class StandingFigure:
    """A figure kept standing per *structure* (the last ``size``), updated per *state* by
    blitting: ``build(structure, state)`` makes it, ``update(fig, state)`` sets the artists
    ``dynamic(fig)`` lists, redrawn alone over a cached background: pixels equal a full draw."""

    def __init__(self, build: Callable, update: Callable, dynamic: Callable, size: int = 6):
        self.build, self.update, self.dynamic, self.size = build, update, dynamic, size
        self.builds = 0
        self._standing: dict = {}  # structure -> (fig, background)

    def figure(self, structure):
        """The standing figure of ``structure``, or ``None``."""
        return self._standing.get(structure, (None,))[0]

    def stand(self, structure, state) -> None:
        """Build the figure of ``structure`` now (in ``state``) unless it stands already."""
        if structure in self._standing:
            return
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        fig = self.build(structure, state)
        _close(fig)  # out of pyplot's registry; still drawable
        FigureCanvasAgg(fig)
        fig.set_dpi(PNG_DPI)
        self.builds += 1
        self._standing[structure] = (fig, self._background(fig))
        while len(self._standing) > self.size:
            del self._standing[next(iter(self._standing))]

    def _background(self, fig):
        """Lay ``fig`` out once, freeze it, draw all but the dynamic artists."""
        fig.draw_without_rendering()
        fig.set_layout_engine("none")
        titles = [(ax.title, ax.title.get_position()) for ax in fig.axes]
        visible = {artist: artist.get_visible() for artist in self.dynamic(fig)}
        for artist in visible:
            artist.set_visible(False)
        fig.canvas.draw()  # the one full draw: the background
        background = fig.canvas.copy_from_bbox(fig.bbox)
        for artist, was_visible in visible.items():
            artist.set_visible(was_visible)
        for title, place in titles:  # where a draw with everything visible puts them
            title.set_position(place)
        return background

    def pixels(self, structure, state) -> np.ndarray:
        """``[H, W, 4]`` uint8 pixels of the figure of ``structure`` in ``state`` (a copy)."""
        self.stand(structure, state)
        self._standing[structure] = self._standing.pop(structure)  # most recent last
        fig, background = self._standing[structure]
        self.update(fig, state)
        fig.canvas.restore_region(background)
        for artist in self.dynamic(fig):
            if artist.get_visible():
                fig.draw_artist(artist)
        return np.array(fig.canvas.buffer_rgba())

    def png(self, structure, state) -> bytes:
        """``encode_png(pixels(structure, state))``."""
        return encode_png(self.pixels(structure, state))


def png_output(png: bytes, text: str) -> dict:
    """A ``display_data`` output of a PNG and its alt ``text``."""
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": text}}


def html_output(markup: str, text: str) -> dict:
    """A ``display_data`` output with HTML and its plain-text twin."""
    return {"output_type": "display_data", "metadata": {},
            "data": {"text/html": markup, "text/plain": text}}


def text_output(text: str) -> dict:
    """``text`` as an output: one HTML paragraph per line."""
    return html_output("".join(f'<p style="margin:0.2em 0">{html.escape(line)}</p>'
                               for line in text.split("\n")), text)


def message_output(message: str) -> dict:
    """A short notice in the output area (at most ``MAX_MESSAGE`` characters)."""
    message = " ".join(str(message).split())
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 1] + "…"
    return html_output(f'<div class="tpx-message" style="border-left: 4px solid #d62728; '
                       f'padding: 0.3em 0.7em; margin: 0.3em 0;">{html.escape(message)}</div>',
                       message)


def png_img(png: bytes, alt: str) -> str:
    """An ``<img>`` with the PNG inline (base64), sized by its pixels."""
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    data = base64.b64encode(png).decode("ascii")
    return (f'<img src="data:image/png;base64,{data}" width="{width}" height="{height}" '
            f'alt="{html.escape(alt)}">')


def outputs_html(outputs: Sequence[dict]) -> str:
    """``outputs`` as one HTML block, PNGs re-encoded in 256 colors as ``<img>``."""
    parts = []
    for output in outputs:
        data = output["data"]
        if "image/png" in data:
            image = Image.open(io.BytesIO(base64.b64decode(data["image/png"])))
            data = {"text/html": png_img(encode_png(np.asarray(image), palette=True),
                                         data["text/plain"])}
        parts.append(data["text/html"])
    return "".join(parts)


@contextlib.contextmanager
def single_thread():
    """Run torch on one thread inside the block (tiny tensors)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_CSS = """
#{p} {{ border: 1px solid var(--pst-color-border, #d0d7de); border-radius: 6px;
        padding: 0.6em 0.8em; margin: 0.5em 0 1em 0; }}
#{p} > input {{ position: absolute; opacity: 0; width: 0; height: 0; margin: 0; }}
#{p} .tpx-controls {{ display: flex !important; flex-wrap: wrap; gap: 0.3em 1.2em;
                      margin-bottom: 0.5em; }}
#{p} .tpx-group {{ display: flex; flex-wrap: wrap; align-items: center; gap: 0.25em; }}
#{p} .tpx-name {{ font-weight: 600; margin-right: 0.2em; }}
#{p} .tpx-controls label {{ cursor: pointer; padding: 0.1em 0.55em; margin: 0;
                            border: 1px solid var(--pst-color-border, #d0d7de);
                            border-radius: 4px; font-size: 0.9em; user-select: none; }}
#{p} .tpx-controls label:hover {{ border-color: var(--pst-color-primary, #0969da); }}
#{p} .tpx-panel {{ display: none; }}
#{p} .tpx-caption {{ display: none; }}
#{p} .tpx-panel img {{ max-width: 100%; height: auto; }}
#{p} .tpx-note {{ font-size: 0.8em; opacity: 0.75; margin: 0.3em 0 0 0; }}
"""
_SELECTED = ("background: var(--pst-color-primary, #0969da); color: #fff; "
             "border-color: var(--pst-color-primary, #0969da);")
_FOCUSED = "outline: 2px solid var(--pst-color-primary, #0969da); outline-offset: 1px;"
_HIDDEN = "position:absolute;opacity:0;width:0;height:0;margin:0"
_DATA_URI = re.compile(r"data:image/png;base64,[A-Za-z0-9+/=]+")


class StaticExplorer:
    """``panels`` ``{(i0, i1, …): html}`` for every combination of the options of ``groups``
    ``[(name, [label, …]), …]``, ``initial`` selected; ids hash the text, not the PNGs."""

    def __init__(self, kind: str, groups: Sequence[tuple[str, Sequence[str]]],
                 panels: Mapping[tuple[int, ...], str], initial: tuple[int, ...] | None = None,
                 note: str | None = None):
        self.kind = kind
        self.groups = [(name, list(options)) for name, options in groups]
        combos = list(itertools.product(*(range(len(o)) for _, o in self.groups)))
        missing = [c for c in combos if c not in panels]
        if missing:
            raise ValueError(f"panels must cover every combination of options (missing {missing[:3]})")
        self.panels = {c: panels[c] for c in combos}
        self.initial = tuple(initial) if initial is not None else combos[0]
        if self.initial not in self.panels:
            raise ValueError(f"initial must be a combination of option indices (got {initial!r})")
        self.note = ("Precomputed when the book was built. Run the notebook to explore any "
                     "value.") if note is None else note
        text = [_DATA_URI.sub("", body) for body in self.panels.values()]
        digest = hashlib.sha1(repr((kind, self.groups, text)).encode()).hexdigest()[:10]
        self.prefix = f"tpx-{kind}-{digest}"
        self.html = self._render()

    def __len__(self) -> int:
        return len(self.panels)

    def _repr_html_(self) -> str:
        return self.html

    def _render(self) -> str:
        p = self.prefix
        radio = lambda g, i: f"{p}-g{g}-{i}"  # noqa: E731
        panel = lambda combo: f"{p}-p" + "-".join(map(str, combo))  # noqa: E731
        rules, inputs, controls = [_CSS.format(p=p)], [], []
        for combo in self.panels:
            chain = " ~ ".join(f"#{radio(g, i)}:checked" for g, i in enumerate(combo))
            rules.append(f"{chain} ~ .tpx-panels > #{panel(combo)} {{ display: block; }}")
        for g, (name, options) in enumerate(self.groups):
            controls.append(f'<div class="tpx-group" role="radiogroup" '
                            f'aria-label="{html.escape(name)}">'
                            f'<span class="tpx-name">{html.escape(name)}</span>')
            for i, option in enumerate(options):
                label = f"label[for={radio(g, i)}]"
                rules += [f"#{radio(g, i)}:checked ~ .tpx-controls {label} {{ {_SELECTED} }}",
                          f"#{radio(g, i)}:focus-visible ~ .tpx-controls {label} {{ {_FOCUSED} }}"]
                checked = " checked" if self.initial[g] == i else ""
                inputs.append(f'<input type="radio" name="{p}-g{g}" id="{radio(g, i)}" '
                              f'style="{_HIDDEN}"{checked}>')
                controls.append(f'<label for="{radio(g, i)}">{html.escape(option)}</label>')
            controls.append("</div>")
        out = [f'<div class="tpx" id="{p}" data-tpx-kind="{html.escape(self.kind)}">', "<style>",
               *rules, "</style>", *inputs, '<div class="tpx-controls" style="display:none">',
               *controls, "</div>", '<div class="tpx-panels">']
        for combo, body in self.panels.items():
            caption = " · ".join(f"{name} {options[i]}"
                                 for (name, options), i in zip(self.groups, combo))
            out.append(f'<div class="tpx-panel" id="{panel(combo)}" '
                       f'data-state="{html.escape(caption)}">'
                       f'<p class="tpx-caption"><strong>{html.escape(caption)}</strong></p>'
                       f"{body}</div>")
        out.append("</div>")
        if self.note:
            out.append(f'<p class="tpx-note">{html.escape(self.note)}</p>')
        out.append("</div>")
        return "\n".join(out)


#: One group of a static twin: its name and its options, each ``(label, {control: value})``.
StateGroup = tuple[str, Sequence[tuple[str, Mapping]]]


def control_states(name: str, values, group: str | None = None) -> StateGroup:
    """A static twin's group: control ``name`` at each of ``values``."""
    return group or name, [(str(value), {name: value}) for value in values]


class Explorer:
    """Controls + an output area, redrawn by ``draw(**values)`` (a list of ``*_output``
    dicts) on every change; displayed, the live widget and its static twin: a panel per
    combination of ``states``' options (``warm()`` runs after it is built)."""

    def __init__(self, name: str, controls: Mapping[str, widgets.ValueWidget],
                 draw: Callable[..., list[dict]], states: Sequence[StateGroup] = (),
                 kind: str = "", note: str | None = None, warm: Callable | None = None):
        self.name = name
        self.controls = dict(controls)
        self.output = widgets.Output()
        self.widget = widgets.VBox([widgets.HBox(list(self.controls.values()),
                                                 layout=widgets.Layout(flex_flow="row wrap")),
                                    self.output])
        self._draw = draw
        self.kind, self.states, self.note, self._warm = kind, list(states), note, warm
        self._first = self.values
        self._static_html: str | None = None
        self._holding = False
        self.redraws = 0
        for control in self.controls.values():
            control.observe(self._changed, names="value")
        self.redraw()

    @property
    def values(self) -> dict:
        """The controls' current values, by name."""
        return {name: control.value for name, control in self.controls.items()}

    def set(self, **values) -> None:
        """Set several controls, then redraw once."""
        unknown = set(values) - set(self.controls)
        if unknown:
            raise ValueError(f"unknown control(s) {sorted(unknown)}; "
                             f"this explorer has {list(self.controls)}")
        self._holding = True
        try:
            for name, value in values.items():
                self.controls[name].value = value
        finally:
            self._holding = False
        self.redraw()

    def _changed(self, _change) -> None:
        if not self._holding:
            self.redraw()

    def outputs(self, **values) -> list[dict]:
        """``draw(**values)``, or a one-line message when it fails (no figure left open)."""
        open_before = _open_figures()
        try:
            return list(self._draw(**values))
        except ValueError as error:
            return [message_output(str(error))]
        except Exception as error:  # noqa: BLE001 — a reader must never see a traceback
            return [message_output(f"cannot draw this: {type(error).__name__}: {error}")]
        finally:
            for number in _open_figures() - open_before:
                _close(number)

    def redraw(self) -> None:
        """Recompute the output area's contents."""
        self.output.outputs = tuple(self.outputs(**self.values))
        self.redraws += 1

    def static(self) -> StaticExplorer:
        """The static twin, drawn now."""
        panels, initial = {}, None
        for combo in itertools.product(*(range(len(options)) for _, options in self.states)):
            values = dict(self._first)
            for (_, options), i in zip(self.states, combo):
                values.update(options[i][1])
            panels[combo] = outputs_html(self.outputs(**values))
            initial = combo if initial is None and values == self._first else initial
        twin = StaticExplorer(self.kind, [(name, [label for label, _ in options])
                                          for name, options in self.states],
                              panels, initial, self.note)
        if self._warm is not None:
            self._warm()
        return twin

    def static_html(self) -> str:
        """The static twin's HTML (``""`` without ``states``), computed once."""
        if self._static_html is None:
            self._static_html = self.static().html if self.states else ""
        return self._static_html

    def __repr__(self) -> str:
        return f"<{self.name} explorer: {', '.join(self.controls)}>"

    def _repr_mimebundle_(self, include=None, exclude=None):
        live = self.widget._repr_mimebundle_  # None once the widget is closed
        bundle = dict(live(include=include, exclude=exclude) or {}) if callable(live) else {}
        bundle["text/plain"] = repr(self)
        static = self.static_html()
        if static:
            bundle["text/html"] = static
        return bundle
