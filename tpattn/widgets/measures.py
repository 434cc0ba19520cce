"""The five measures in an output area: an HTML table, the verdict, a fast bar chart."""
from __future__ import annotations

import copy
import functools
import html
from typing import Mapping


from tpattn.bugs.modes import run
from tpattn.check.core import MEASURES, TOLERANCE
from tpattn.config import Config
from tpattn.viz.sharding import measures_figure, set_measures, zero_floor
from tpattn.viz.tables import MEASURE_LABELS, format_measure
from tpattn.viz.style import FAIL_COLOR, PASS_COLOR
from .core import StandingFigure, single_thread

__all__ = ["MeasuresPlot", "live_run", "measures_html"]


def live_run(seed, mode, cfg: Config | None = None, simulate: str = "fixture") -> dict:
    """``run(seed, mode, cfg, simulate=simulate)`` on one thread, remembered for 256 states
    (``True`` is not ``1``); a new dict each call; errors are not remembered."""
    try:
        return copy.deepcopy(_remembered_run(seed, mode, cfg, simulate))
    except TypeError:  # not hashable, so not a value run accepts; let run say why
        with single_thread():
            return run(seed, mode, cfg, simulate=simulate)


@functools.lru_cache(maxsize=256, typed=True)
def _remembered_run(seed, mode, cfg, simulate) -> dict:
    with single_thread():
        return run(seed, mode, cfg, simulate=simulate)


def measures_html(result: Mapping) -> str:
    """The verdict and a table: each measure, its value and whether it is below the tolerance."""
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
            f'<span class="tpx-verdict" style="color:{color}">'
            f'{"PASSED" if result["passed"] else "FAILED"}</span></strong></p>'
            f'<table class="tpx-table" style="border-collapse:collapse; margin:0.2em 0">'
            f'<thead><tr><th style="{cell}">measure (max |dense − TP|)</th>'
            f'<th style="{cell}; text-align:right">value</th><th style="{cell}">vs tolerance</th>'
            f"</tr></thead><tbody>{rows}</tbody></table></div>")


def _measures_dynamic(fig) -> list:
    """The bars, what lies over them (threshold line, spines), their value labels and the title."""
    ax = fig.axes[0]
    return [*ax.patches, *ax.lines, *ax.spines.values(), *ax.texts[:len(MEASURES)], ax.title]


class MeasuresPlot(StandingFigure):
    """``measures_figure(result)`` as PNG bytes, standing per zero floor."""

    def __init__(self):
        super().__init__(lambda _floor, result: measures_figure(result), set_measures,
                         _measures_dynamic, size=2)

    def png(self, result: Mapping) -> bytes:
        """PNG bytes of ``measures_figure(result)``."""
        return super().png(zero_floor([float(result[m]) for m in MEASURES]), result)
