"""The explorers of RoPE (chapter 3), attention (4), sharding (6), seed × mode (8–10), SP (12)."""
from __future__ import annotations

import copy
from dataclasses import replace
import functools
import html
from typing import Mapping

import ipywidgets as widgets

from tpattn.bugs.modes import run
from tpattn.check.core import EQUIVALENCE, MEASURES, MODES, SEEDS, SP_MODES, TOLERANCE
from tpattn.config import Config
from tpattn.block.layers import rope_angles
from tpattn.viz.layers import (attention_dynamic_artists, attention_heatmaps, rope_dynamic_artists,
                               rope_rotation_figure, set_attention_state, set_rope_position)
from tpattn.viz.heads import heads_picture
from tpattn.viz.sharding import measures_figure, set_measures, zero_floor
from tpattn.viz.style import FAIL_COLOR, PASS_COLOR
from tpattn.viz.tables import MEASURE_LABELS, format_measure, measures_table
from .core import (Explorer, StandingFigure, config_controls, control_states, html_output,
                   mode_control, png_output, seed_control, single_thread, text_output)
from .kv import heads_explorer, kv_caption, layout_states

__all__ = ["rope_explorer", "attention_explorer", "sharding_explorer", "seed_mode_explorer",
           "sp_explorer", "SP_EXPLORER_CONFIG", "ROPE_POSITIONS", "ATTENTION_LAYOUTS",
           "ATTENTION_SEEDS", "SHARDING_LAYOUTS", "MAX_DRAWN_HEADS", "MeasuresPlot", "live_run",
           "measures_html"]

#: RoPE positions precomputed for the book (~0.5 s each).
ROPE_POSITIONS = (0, 1, 3, 8, 16)
#: Head layouts of the attention explorer: name → (query_heads, kv_heads).
ATTENTION_LAYOUTS = {"MHA 4q/4kv": (4, 4), "GQA 4q/2kv": (4, 2), "MQA 4q/1kv": (4, 1)}
ATTENTION_SEEDS = (11, 17)
#: (query_heads, kv_heads, world_size) of the static sharding explorer; the last two are invalid.
SHARDING_LAYOUTS = ((4, 2, 2), (4, 2, 1), (8, 4, 2), (8, 8, 4), (8, 2, 4), (6, 4, 2))
#: The heads→ranks figure stays readable up to this many query heads.
MAX_DRAWN_HEADS = 64
#: Chapter 12's block: 8 tokens, so that 2 ranks hold 4 each.
SP_EXPLORER_CONFIG = Config(seq=8, sequence_parallel=True)


def _rope_caption(position: int, head_dim: int) -> str:
    """Each pair's speed (rad/position) and its angle at ``position``."""
    speeds = rope_angles(2, head_dim)[1, 0, 0].tolist()                 # angle per step
    angles = rope_angles(position + 1, head_dim)[position, 0, 0].tolist()  # at `position`
    parts = [f"pair {i}: {s:.3g} rad/pos, at m={position} {a:.3g} rad"
             for i, (s, a) in enumerate(zip(speeds, angles))]
    return f"head_dim {head_dim}: {head_dim // 2} pairs — " + "; ".join(parts)


def rope_explorer(position: int = 3, head_dim: int = 8, max_position: int = 16) -> Explorer:
    """RoPE's rotations at one position; the static twin at ``ROPE_POSITIONS``."""
    controls = {
        "position": widgets.IntSlider(value=position, min=0, max=max_position,
                                      description="position", continuous_update=False),
        "head_dim": widgets.Dropdown(options=[2, 4, 8, 16, 32], value=head_dim,
                                     description="head_dim", layout=widgets.Layout(width="11em")),
    }
    standing = StandingFigure(build=lambda shape, at: rope_rotation_figure(at, *shape),
                              update=set_rope_position, dynamic=rope_dynamic_artists)
    def draw(position, head_dim):
        png = standing.png((head_dim, max_position), position)  # may raise: before the text
        return [text_output(_rope_caption(position, head_dim)), png_output(
            png, f"RoPE rotations at position {position}, head_dim {head_dim}")]
    def warm():  # every head_dim's figure, for fast updates later
        for other in controls["head_dim"].options:
            standing.stand((other, max_position), position)
    explorer = Explorer("RoPE", controls, draw, [control_states("position", ROPE_POSITIONS)],
                        kind="rope", warm=warm)
    explorer.standing = standing
    return explorer


def attention_config(query_heads: int, kv_heads: int, base: Config | None = None) -> Config:
    """``base`` (default ``Config()``) with these head counts on one rank (dense attention)."""
    return replace(Config() if base is None else base, query_heads=query_heads,
                   kv_heads=kv_heads, world_size=1)


def attention_explorer(seed: int = 11, heads: str = "GQA 4q/2kv", batch_index: int = 0,
                       cfg: Config | None = None) -> Explorer:
    """Attention probabilities of every query head; the static twin: ``ATTENTION_LAYOUTS`` ×
    ``ATTENTION_SEEDS``."""
    controls = {
        "heads": widgets.ToggleButtons(options=list(ATTENTION_LAYOUTS), value=heads,
                                       description="heads", style={"button_width": "auto"}),
        "seed": seed_control(seed),
        "batch_index": widgets.IntText(value=batch_index, description="batch",
                                       layout=widgets.Layout(width="9em")),
    }
    standing = StandingFigure(build=lambda c, state: attention_heatmaps(c, *state),
                              update=lambda fig, state: set_attention_state(fig, *state),
                              dynamic=attention_dynamic_artists)
    def draw(heads, seed, batch_index):
        c = attention_config(*ATTENTION_LAYOUTS[heads], base=cfg)
        with single_thread():
            png = standing.png(c, (seed, batch_index))
        share = f"{c.kv_heads}/{c.query_heads} = {c.kv_heads / c.query_heads:.0%}"
        return [text_output(f"{c.query_heads} query heads read {c.kv_heads} KV head(s), "
                            f"{c.group_size} query heads per KV head: K/V projections and the "
                            f"KV cache are {share} of multi-head attention's"),
                png_output(png, f"attention probabilities, {heads}, seed {seed}")]
    explorer = Explorer("attention", controls, draw, [control_states("heads", ATTENTION_LAYOUTS),
                                                      control_states("seed", ATTENTION_SEEDS)],
                        kind="attention")
    explorer.standing = standing
    return explorer


def sharding_caption(cfg: Config) -> str:
    """Which heads each rank holds (with replicas: ``kv_caption``)."""
    if cfg.kv_heads < cfg.world_size:  # replicas: chapter 13's caption
        return kv_caption(cfg)
    q, kv = cfg.local_query_heads, cfg.local_kv_heads
    span = lambda prefix, first, n: (f"{prefix}{first}" if n == 1  # noqa: E731
                                     else f"{prefix}{first}–{prefix}{first + n - 1}")
    ranks = [f"rank {r}: {span('q', r * q, q)} + {span('kv', r * kv, kv)}"
             for r in range(min(cfg.world_size, 8))]
    if cfg.world_size > 8:
        ranks.append(f"… {cfg.world_size - 8} more ranks")
    return (f"each of {cfg.world_size} rank(s) holds {q} query head(s) and the {kv} KV head(s) "
            f"they read — " + "; ".join(ranks))


def sharding_explorer(query_heads: int = 4, kv_heads: int = 2, world_size: int = 2,
                      layouts=None) -> Explorer:
    """Which rank holds which heads; the static twin: ``layouts`` (``SHARDING_LAYOUTS``)."""
    controls = config_controls(query_heads=query_heads, kv_heads=kv_heads, world_size=world_size)
    layouts = SHARDING_LAYOUTS if layouts is None else layouts
    return heads_explorer("sharding", controls, MAX_DRAWN_HEADS, sharding_caption,
                          heads_picture, [layout_states(layouts)])


def live_run(seed, mode, cfg: Config | None = None, simulate: str = "fixture") -> dict:
    """``run(seed, mode, cfg, simulate=simulate)`` on one thread, remembered for 256 states
    (``True`` is not ``1``); a new dict each call; errors are not remembered."""
    try:
        return copy.deepcopy(_remembered_run(seed, mode, cfg, simulate))
    except TypeError:  # not hashable, so not a value run accepts; let run say why
        return _remembered_run.__wrapped__(seed, mode, cfg, simulate)


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


def seed_mode_explorer(seed: int = 11, mode: str = EQUIVALENCE, cfg: Config | None = None,
                       simulate: str = "fixture", modes=MODES, name: str = "seed × mode",
                       kind: str = "seed-mode", seeds=SEEDS) -> Explorer:
    """``run(seed, mode, cfg, simulate=simulate)``: the five measures, the verdict, the bars;
    the twin: ``seeds`` × ``modes``."""
    controls = {"seed": seed_control(seed), "mode": mode_control(mode, modes)}
    plot = MeasuresPlot()
    what = "SP mode" if kind.startswith("sp") else "mode"
    def draw(seed, mode):
        result = live_run(seed, mode, cfg, simulate=simulate)
        return [html_output(measures_html(result), measures_table([result])), png_output(
            plot.png(result), f"the five measures of seed {seed}, {what} {mode}, against 1e-6")]
    explorer = Explorer(name, controls, draw, [control_states("seed", seeds),
                                               control_states("mode", modes)], kind=kind)
    explorer.plot = plot
    return explorer


def sp_explorer(seed: int = 11, mode: str = EQUIVALENCE, cfg: Config | None = None) -> Explorer:
    """``seed_mode_explorer`` on simulated ranks with ``SP_MODES``."""
    cfg = SP_EXPLORER_CONFIG if cfg is None else cfg
    if not cfg.sequence_parallel:
        raise ValueError("cfg must have sequence_parallel=True (the explorer runs the SP block)")
    return seed_mode_explorer(seed, mode, cfg, simulate="ranks", modes=SP_MODES,
                              name="seed × SP mode", kind="sp-seed-mode")
