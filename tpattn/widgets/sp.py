"""Chapter 12's explorer: seed × sequence-parallel mode, live and static (see ``tpattn.widgets``).

``sp_explorer()`` runs ``run(seed, mode, cfg, simulate="ranks")`` with ``cfg.sequence_parallel``
and shows the five measures, the verdict and the bars against 1e-6; ``static_sp_explorer()``
precomputes every ``seeds × SP_MODES`` state for the HTML book.
"""
from __future__ import annotations

import ipywidgets as widgets

from ..check import EQUIVALENCE, SEEDS, SP_MODES
from ..config import Config
from .core import Explorer, html_output, png_img, png_output, seed_control
from .measures import MeasuresPlot, live_run, measures_html, measures_text
from .static import StaticExplorer

__all__ = ["SP_EXPLORER_CONFIG", "sp_explorer", "static_sp_explorer"]

#: The chapter's block: the seed's shapes with 8 tokens, so that 2 ranks hold 4 each.
SP_EXPLORER_CONFIG = Config(seq=8, sequence_parallel=True)


def _sp_config(cfg: Config | None) -> Config:
    cfg = SP_EXPLORER_CONFIG if cfg is None else cfg
    if not cfg.sequence_parallel:
        raise ValueError("cfg must have sequence_parallel=True (the explorer runs the SP block)")
    return cfg


def sp_explorer(seed: int = 11, mode: str = EQUIVALENCE, cfg: Config | None = None) -> Explorer:
    """Seed × SP mode on simulated ranks: the five measures, the verdict, the bars."""
    cfg = _sp_config(cfg)
    controls = {"seed": seed_control(seed),
                "mode": widgets.ToggleButtons(options=list(SP_MODES), value=mode, description="mode",
                                              style={"button_width": "auto"})}
    plot = MeasuresPlot()

    def draw(seed, mode):
        result = live_run(seed, mode, cfg, simulate="ranks")
        return [html_output(measures_html(result), measures_text(result)),
                png_output(plot.png(result), f"<measures, seed {seed}, mode {mode}>")]

    return Explorer("seed × SP mode", controls, draw,
                    static=lambda: static_sp_explorer(cfg=cfg, initial=(seed, mode), plot=plot))


def static_sp_explorer(seeds=SEEDS, modes=SP_MODES, cfg: Config | None = None,
                       initial=(11, EQUIVALENCE), plot: MeasuresPlot | None = None) -> StaticExplorer:
    """Measures, verdict and bars of ``run(seed, mode, cfg, "ranks")`` for every ``seeds × modes``."""
    cfg = _sp_config(cfg)
    plot = MeasuresPlot() if plot is None else plot
    panels = {}
    for i, seed in enumerate(seeds):
        for j, mode in enumerate(modes):
            result = live_run(seed, mode, cfg, simulate="ranks")  # remembered for the live one
            panels[i, j] = measures_html(result) + png_img(
                plot.png(result, palette=True),
                f"the five measures of seed {seed}, SP mode {mode}, against 1e-6")
    start = (list(seeds).index(initial[0]) if initial[0] in seeds else 0,
             list(modes).index(initial[1]) if initial[1] in modes else 0)
    return StaticExplorer("sp-seed-mode", [("seed", [str(s) for s in seeds]), ("mode", list(modes))],
                          panels, initial=start)
