"""The five measures in an output area: an HTML table, the verdict, and a fast bar chart.

``MeasuresPlot`` draws exactly ``tpattn.viz.sharding.measures_figure`` but builds it only once:
later results move the bars and relabel them, and only those are drawn again over a cached
background. Building and drawing that figure costs ~100+ ms on a small machine; the update
costs a fraction, which keeps the seed × mode explorer interactive.
"""
from __future__ import annotations

import copy
import functools
import html
from typing import Mapping

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg

from ..check import MEASURES, TOLERANCE, run
from ..config import Config
from ..viz.sharding import MEASURE_LABELS, format_measure, measures_figure, measures_table
# measures_figure's own rules for where 0 is drawn and how a bar is labelled
from ..viz.sharding import value_label, zero_floor
from ..viz.style import FAIL_COLOR, PASS_COLOR
from .core import encode_png, single_thread

__all__ = ["MeasuresPlot", "live_run", "measures_html", "measures_text", "verdict"]


def live_run(seed, mode, cfg: Config | None = None, simulate: str = "fixture") -> dict:
    """``run(seed, mode, cfg, simulate=simulate)`` on one thread (see ``single_thread``),
    remembered for the last 256 states: a reader clicking back to a seed or mode sees its
    result again without the ~5 ms run. Returns a new dict each call (the remembered one is
    never handed out); ``run``'s ``ValueError`` for a bad value is raised, not remembered."""
    key = (type(seed), seed, type(mode), mode, cfg, simulate)
    try:
        hash(key)
    except TypeError:  # not a value run accepts; let run say why
        with single_thread():
            return run(seed, mode, cfg, simulate=simulate)
    return copy.deepcopy(_remembered_run(*key))


@functools.lru_cache(maxsize=256)
def _remembered_run(_seed_type, seed, _mode_type, mode, cfg, simulate) -> dict:
    with single_thread():
        return run(seed, mode, cfg, simulate=simulate)


def verdict(result: Mapping) -> str:
    """``"PASSED"`` or ``"FAILED"``."""
    return "PASSED" if result["passed"] else "FAILED"


def measures_text(result: Mapping) -> str:
    """The plain-text twin of ``measures_html``: ``viz.sharding.measures_table`` of one result."""
    return measures_table([result])


def measures_html(result: Mapping) -> str:
    """Verdict line and a table: each measure, its value (``format_measure``: values below
    1e-6 print as ``< 1e-06``, so the text does not depend on the CPU's last bits) and
    whether it is below the tolerance."""
    color = PASS_COLOR if result["passed"] else FAIL_COLOR
    cell = "padding:0.05em 1.2em 0.05em 0"
    rows = "".join(
        f'<tr><td style="{cell}">{html.escape(MEASURE_LABELS[m])}</td>'
        f'<td style="{cell}; text-align:right; font-family:monospace">'
        f"{format_measure(result[m])}</td>"
        f'<td style="{cell}; color:{PASS_COLOR if result[m] < TOLERANCE else FAIL_COLOR}">'
        f'{"below" if result[m] < TOLERANCE else "ABOVE"} 1e-6</td></tr>'
        for m in MEASURES)
    return (f'<div class="tpx-measures">'
            f'<p style="margin:0.2em 0"><strong>seed {result["seed"]}, mode '
            f'<code>{html.escape(result["mode"])}</code>: '
            f'<span class="tpx-verdict" style="color:{color}">{verdict(result)}</span></strong></p>'
            f'<table class="tpx-table" style="border-collapse:collapse; margin:0.2em 0">'
            f'<thead><tr><th style="{cell}">measure (max |dense − TP|)</th>'
            f'<th style="{cell}; text-align:right">value</th><th style="{cell}">vs tolerance</th>'
            f"</tr></thead><tbody>{rows}</tbody></table></div>")


class MeasuresPlot:
    """``measures_figure(result)`` as PNG bytes, fast enough for a control being clicked.

    The first result (and any whose zero floor differs) builds ``measures_figure`` and keeps
    it, with its background — everything but bars, value labels and title — cached. Later
    results move the bars, relabel them and retitle, then draw only those over the cached
    background. The pixels equal a full draw of ``measures_figure(result)``:
    ``tests/test_widgets.py`` compares them for every seed and mode, so if ``measures_figure``
    changes its drawing, that test says this mirror must follow.
    """

    def __init__(self, dpi: int = 100):
        self.dpi = dpi
        self.full_draws = 0
        self._fig = None
        self._floor = None
        self._background = None

    @staticmethod
    def _dynamic(ax):
        """Artists drawn over the background on every result, in z order: the bars, what lies
        on top of them (threshold line, spines), their value labels (``measures_figure``'s
        first texts; the threshold's label stays in the background) and the title."""
        return [*ax.patches, *ax.lines, *ax.spines.values(), *ax.texts[:len(MEASURES)],
                ax.title]

    def _keep(self, fig, floor: float) -> None:
        """Keep ``fig`` (a fresh ``measures_figure``) and cache its background."""
        if self._fig is not None:
            plt.close(self._fig)
        plt.close(fig)  # out of pyplot's registry (nothing to flush into a cell); still drawable
        FigureCanvasAgg(fig)
        fig.set_dpi(self.dpi)
        fig.canvas.draw()  # resolves the constrained layout once …
        fig.set_layout_engine("none")  # … and freezes it
        titles = [ax.title.get_position() for ax in fig.axes]  # placed by that draw
        dynamic = [artist for ax in fig.axes for artist in self._dynamic(ax)]
        visible = [artist.get_visible() for artist in dynamic]  # (top/right spines: hidden)
        for artist in dynamic:
            artist.set_visible(False)
        fig.canvas.draw()
        self._background = fig.canvas.copy_from_bbox(fig.bbox)
        for artist, was_visible in zip(dynamic, visible):
            artist.set_visible(was_visible)
        for ax, title in zip(fig.axes, titles):
            ax.title.set_position(title)  # drawing with it hidden moved it
        self._fig, self._floor = fig, floor
        self.full_draws += 1

    def _update(self, result: Mapping, values: list[float]) -> None:
        """What ``measures_figure`` varies with the result, set on the kept figure."""
        ax = self._fig.axes[0]
        for bar, label, value in zip(ax.patches, ax.texts, values):  # MEASURES order
            bar.set_width(value or self._floor)
            bar.set_facecolor(PASS_COLOR if value < TOLERANCE else FAIL_COLOR)
            label.set_x((value or self._floor) * 1.4)
            label.set_text(value_label(value))
        ax.title.set_text(f"seed {result['seed']}, mode {result['mode']}: {verdict(result)}")
        ax.title.set_color(PASS_COLOR if result["passed"] else FAIL_COLOR)

    def png(self, result: Mapping, palette: bool = False) -> bytes:
        """PNG bytes of ``measures_figure(result)``: fast to encode (live updates), or 256-color
        and small with ``palette=True`` (the precomputed panels of a page)."""
        values = [float(result[m]) for m in MEASURES]
        floor = zero_floor(values)
        if self._fig is None or floor != self._floor:
            self._keep(measures_figure(result), floor)
        else:
            self._update(result, values)
        canvas = self._fig.canvas
        canvas.restore_region(self._background)
        for ax in self._fig.axes:
            for artist in self._dynamic(ax):
                self._fig.draw_artist(artist)
        rgba = np.asarray(canvas.buffer_rgba())  # encoded as is: dropping alpha costs a copy
        return encode_png(rgba, palette=palette, compress_level=6 if palette else 1)
