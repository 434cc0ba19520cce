"""The book's explorers, each a live ``Explorer`` and its ``StaticExplorer`` twin:
``rope_explorer`` (chapter 3), ``attention_explorer`` (4), ``sharding_explorer`` (6) and
``seed_mode_explorer`` (8–10); the static states are the constants below. Every number
comes from the package and every figure from ``tpattn.viz``."""
from __future__ import annotations

import functools
import html

import ipywidgets as widgets

from ..check import EQUIVALENCE, MODES, SEEDS
from ..config import Config
from ..layers import rope_angles
from ..viz.layers import (attention_dynamic_artists, attention_heatmaps, rope_dynamic_artists,
                          rope_rotation_figure, set_attention_state, set_rope_position)
from ..viz.frames import HeadsPicture, heads_svg
from ..viz.kv import replica_groups_layout
from ..viz.sharding import heads_layout
from .core import (Explorer, StandingFigure, config_controls, config_panel,
                   drawn_config, html_output, mode_control, png_img, png_output, seed_control,
                   single_thread)
from .measures import MeasuresPlot, live_run, measures_html, measures_text
from .static import StaticExplorer

__all__ = [
    "rope_explorer", "attention_explorer", "sharding_explorer", "seed_mode_explorer",
    "static_rope_explorer", "static_attention_explorer", "static_sharding_explorer",
    "static_seed_mode_explorer",
    "ROPE_POSITIONS", "ATTENTION_LAYOUTS", "ATTENTION_SEEDS",
    "SHARDING_LAYOUTS", "MAX_DRAWN_HEADS",
]

#: RoPE positions precomputed for the book (``max_position`` 16); each figure costs ~0.5 s of
#: build time on a small machine, so the set stays small.
ROPE_POSITIONS = (0, 1, 3, 8, 16)
#: Head layouts of the attention explorer: name → (query_heads, kv_heads).
ATTENTION_LAYOUTS = {"MHA 4q/4kv": (4, 4), "GQA 4q/2kv": (4, 2), "MQA 4q/1kv": (4, 1)}
ATTENTION_SEEDS = (11, 17)
#: (query_heads, kv_heads, world_size) of the static sharding explorer; the last two are invalid.
SHARDING_LAYOUTS = ((4, 2, 2), (4, 2, 1), (8, 4, 2), (8, 8, 4), (8, 2, 4), (6, 4, 2))
#: The heads→ranks figure stays readable up to this many query heads.
MAX_DRAWN_HEADS = 64


# --- chapter 3: RoPE -----------------------------------------------------------------------

def _rope_caption(position: int, head_dim: int) -> tuple[str, str]:
    """Text and HTML: each pair's speed (rad/position) and its angle at ``position``."""
    speeds = rope_angles(2, head_dim)[1, 0, 0].tolist()                 # angle per step
    angles = rope_angles(position + 1, head_dim)[position, 0, 0].tolist()  # at `position`
    parts = [f"pair {i}: {s:.3g} rad/pos, at m={position} {a:.3g} rad"
             for i, (s, a) in enumerate(zip(speeds, angles))]
    text = f"head_dim {head_dim}: {head_dim // 2} pairs — " + "; ".join(parts)
    return text, f'<p style="margin:0.2em 0">{html.escape(text)}</p>'


def _rope_standing() -> StandingFigure:
    """``rope_rotation_figure`` standing per ``(head_dim, max_position)``, moved per position."""
    return StandingFigure(build=lambda shape, position: rope_rotation_figure(position, *shape),
                          update=set_rope_position, dynamic=rope_dynamic_artists)


def rope_explorer(position: int = 3, head_dim: int = 8, max_position: int = 16) -> Explorer:
    """RoPE's rotations at one position: every channel pair turns at its own frequency."""
    controls = {
        "position": widgets.IntSlider(value=position, min=0, max=max_position,
                                      description="position", continuous_update=False),
        "head_dim": widgets.Dropdown(options=[2, 4, 8, 16, 32], value=head_dim,
                                     description="head_dim", layout=widgets.Layout(width="11em")),
    }
    standing = _rope_standing()

    def draw(position, head_dim):
        png = standing.png((head_dim, max_position), position)  # may raise: before the text
        text, markup = _rope_caption(position, head_dim)
        return [html_output(markup, text), png_output(png, f"<RoPE at position {position}>")]

    def static():
        twin = static_rope_explorer(head_dim=head_dim, max_position=max_position,
                                    initial=position, standing=standing)
        for other in controls["head_dim"].options:  # while the cell runs: every head_dim's
            standing.stand((other, max_position), position)  # figure, for fast updates later
        return twin

    explorer = Explorer("RoPE", controls, draw, static=static)
    explorer.standing = standing
    return explorer


def static_rope_explorer(positions=None, head_dim: int = 8, max_position: int = 16,
                         initial: int = 3, standing: StandingFigure | None = None
                         ) -> StaticExplorer:
    """The RoPE figure at each of ``positions`` (default ``ROPE_POSITIONS``) for one
    ``head_dim``, drawn on ``standing`` (the live explorer's: one build)."""
    positions = ROPE_POSITIONS if positions is None else positions
    standing = _rope_standing() if standing is None else standing
    panels = {(i,): _rope_caption(position, head_dim)[1] + png_img(
        standing.png((head_dim, max_position), position, palette=True),
        f"RoPE rotations at position {position}, head_dim {head_dim}")
        for i, position in enumerate(positions)}
    return StaticExplorer("rope", [("position", [str(p) for p in positions])], panels,
                          initial=_index_of((initial,), (positions,)))


# --- chapter 4: attention and GQA ----------------------------------------------------------

def attention_config(query_heads: int, kv_heads: int, base: Config | None = None) -> Config:
    """``base`` (default ``Config()``) with these head counts on one rank (dense attention)."""
    fields = (Config() if base is None else base).as_dict()
    fields.update(query_heads=query_heads, kv_heads=kv_heads, world_size=1)
    return Config(**fields)


def _attention_caption(cfg: Config) -> tuple[str, str]:
    share = cfg.kv_heads / cfg.query_heads
    text = (f"{cfg.query_heads} query heads read {cfg.kv_heads} KV head(s), "
            f"{cfg.group_size} query heads per KV head: K/V projections and the KV cache "
            f"are {cfg.kv_heads}/{cfg.query_heads} = {share:.0%} of multi-head attention's")
    return text, f'<p style="margin:0.2em 0">{html.escape(text)}</p>'


def _attention_standing() -> StandingFigure:
    """``attention_heatmaps`` standing per ``Config``, redrawn per ``(seed, batch_index)``."""
    return StandingFigure(build=lambda cfg, state: attention_heatmaps(cfg, *state),
                          update=lambda fig, state: set_attention_state(fig, *state),
                          dynamic=attention_dynamic_artists)


def attention_explorer(seed: int = 11, heads: str = "GQA 4q/2kv", batch_index: int = 0,
                       cfg: Config | None = None) -> Explorer:
    """Attention probabilities of every query head; frames colored by the KV head they share."""
    controls = {
        "heads": widgets.ToggleButtons(options=list(ATTENTION_LAYOUTS), value=heads,
                                       description="heads", style={"button_width": "auto"}),
        "seed": seed_control(seed),
        "batch_index": widgets.IntText(value=batch_index, description="batch",
                                       layout=widgets.Layout(width="9em")),
    }
    standing = _attention_standing()

    def draw(heads, seed, batch_index):
        layout_cfg = attention_config(*ATTENTION_LAYOUTS[heads], base=cfg)
        with single_thread():
            png = standing.png(layout_cfg, (seed, batch_index))
        text, markup = _attention_caption(layout_cfg)
        return [html_output(markup, text), png_output(png, f"<attention, {heads}, seed {seed}>")]

    explorer = Explorer("attention", controls, draw, static=lambda: static_attention_explorer(
        cfg=cfg, initial=(heads, seed), standing=standing))
    explorer.standing = standing
    return explorer


def static_attention_explorer(layouts=tuple(ATTENTION_LAYOUTS), seeds=ATTENTION_SEEDS,
                              cfg: Config | None = None, initial=("GQA 4q/2kv", 11),
                              standing: StandingFigure | None = None) -> StaticExplorer:
    """The heat maps for every ``layouts × seeds`` (names from ``ATTENTION_LAYOUTS``), drawn
    on ``standing`` (the live explorer's: one build per layout)."""
    standing = _attention_standing() if standing is None else standing
    panels = {}
    for i, name in enumerate(layouts):
        layout_cfg = attention_config(*ATTENTION_LAYOUTS[name], base=cfg)
        for j, seed in enumerate(seeds):
            with single_thread():
                png = standing.png(layout_cfg, (seed, 0), palette=True)
            panels[i, j] = _attention_caption(layout_cfg)[1] + png_img(
                png, f"attention probabilities, {name}, seed {seed}")
    return StaticExplorer("attention", [("heads", list(layouts)), ("seed", [str(s) for s in seeds])],
                          panels, initial=_index_of(initial, (layouts, seeds)))


# --- chapter 6: heads to ranks -------------------------------------------------------------

def sharding_config(query_heads, kv_heads, world_size) -> Config:
    """The fixture's ``Config`` with these heads and ranks (``drawn_config``)."""
    return drawn_config(MAX_DRAWN_HEADS, query_heads=query_heads, kv_heads=kv_heads,
                        world_size=world_size)


def _sharding_caption(cfg: Config) -> tuple[str, str]:
    if cfg.kv_heads < cfg.world_size:  # replicas: chapter 13's caption
        from .kv import kv_caption

        return kv_caption(cfg)
    q, kv = cfg.local_query_heads, cfg.local_kv_heads
    span = lambda prefix, first, n: (f"{prefix}{first}" if n == 1  # noqa: E731
                                     else f"{prefix}{first}–{prefix}{first + n - 1}")
    ranks = [f"rank {r}: {span('q', r * q, q)} + {span('kv', r * kv, kv)}"
             for r in range(min(cfg.world_size, 8))]
    if cfg.world_size > 8:
        ranks.append(f"… {cfg.world_size - 8} more ranks")
    text = (f"each of {cfg.world_size} rank(s) holds {q} query head(s) and the {kv} KV head(s) "
            f"they read — " + "; ".join(ranks))
    return text, f'<p style="margin:0.2em 0">{html.escape(text)}</p>'


def layout_picture(cfg: Config) -> HeadsPicture:
    """The heads→ranks picture of ``cfg``, as ``heads_to_ranks_figure`` chooses it."""
    return replica_groups_layout(cfg) if cfg.kv_heads < cfg.world_size else heads_layout(cfg)


def sharding_explorer(query_heads: int = 4, kv_heads: int = 2, world_size: int = 2) -> Explorer:
    """Which rank holds which heads; an invalid layout shows ``Config``'s own message."""
    controls = config_controls(query_heads=query_heads, kv_heads=kv_heads,
                               world_size=world_size)

    @functools.lru_cache(maxsize=32)  # a layout shown again: its outputs, as they were
    def shown(cfg: Config) -> tuple[dict, dict]:
        text, markup = _sharding_caption(cfg)
        return (html_output(markup, text),
                html_output(heads_svg(layout_picture(cfg)), f"<heads to ranks, "
                            f"{cfg.query_heads}/{cfg.kv_heads}/{cfg.world_size}>"))

    def draw(query_heads, kv_heads, world_size):
        return list(shown(sharding_config(query_heads, kv_heads, world_size)))

    explorer = Explorer("sharding", controls, draw, static=lambda: static_sharding_explorer(
        initial=(query_heads, kv_heads, world_size)))
    explorer.shown = shown
    return explorer


def static_sharding_explorer(layouts=None, initial=(4, 2, 2)) -> StaticExplorer:
    """The heads→ranks SVG for each ``(query_heads, kv_heads, world_size)`` of ``layouts``
    (default ``SHARDING_LAYOUTS``); an invalid one's panel shows the message."""
    layouts = [tuple(layout) for layout in (SHARDING_LAYOUTS if layouts is None else layouts)]
    panels = {(i,): config_panel(lambda: sharding_config(*layout), lambda cfg: (
        _sharding_caption(cfg)[1] + heads_svg(layout_picture(cfg))))
        for i, layout in enumerate(layouts)}
    labels = ["{} q · {} kv · {} ranks".format(*layout) for layout in layouts]
    start = layouts.index(tuple(initial)) if tuple(initial) in layouts else 0
    return StaticExplorer("sharding", [("layout", labels)], panels, initial=(start,))


# --- chapters 8–10: seed × mode ------------------------------------------------------------

def seed_mode_explorer(seed: int = 11, mode: str = EQUIVALENCE, cfg: Config | None = None,
                       simulate: str = "fixture", modes=MODES, name: str = "seed × mode",
                       kind: str = "seed-mode") -> Explorer:
    """``run(seed, mode, cfg, simulate=simulate)``: the five measures, the verdict, the bars
    (``modes``: the buttons; ``name``, ``kind``: the explorer's and static twin's names)."""
    controls = {"seed": seed_control(seed), "mode": mode_control(mode, modes)}
    plot = MeasuresPlot()

    def draw(seed, mode):
        result = live_run(seed, mode, cfg, simulate=simulate)
        return [html_output(measures_html(result), measures_text(result)),
                png_output(plot.png(result), f"<measures, seed {seed}, mode {mode}>")]

    explorer = Explorer(name, controls, draw, static=lambda: static_seed_mode_explorer(
        modes=modes, cfg=cfg, initial=(seed, mode), plot=plot, simulate=simulate, kind=kind))
    explorer.plot = plot  # its full_draws count shows how often the figure was rebuilt
    return explorer


def static_seed_mode_explorer(seeds=SEEDS, modes=MODES, cfg: Config | None = None,
                              initial=(11, EQUIVALENCE), plot: MeasuresPlot | None = None,
                              simulate: str = "fixture", kind: str = "seed-mode") -> StaticExplorer:
    """Measures, verdict and bars of ``run(seed, mode, cfg, simulate=simulate)`` for every
    ``seeds × modes``."""
    plot = MeasuresPlot() if plot is None else plot
    what = "SP mode" if kind.startswith("sp") else "mode"
    panels = {}
    for i, seed in enumerate(seeds):
        for j, mode in enumerate(modes):
            result = live_run(seed, mode, cfg, simulate=simulate)  # the live explorer's too
            panels[i, j] = measures_html(result) + png_img(
                plot.png(result, palette=True),
                f"the five measures of seed {seed}, {what} {mode}, against 1e-6")
    return StaticExplorer(kind, [("seed", [str(s) for s in seeds]), ("mode", list(modes))],
                          panels, initial=_index_of(initial, (seeds, modes)))


def _index_of(values, options) -> tuple[int, ...]:
    """Indices of ``values`` in ``options`` (0 where a value is not one of the options)."""
    return tuple(list(opts).index(v) if v in opts else 0 for v, opts in zip(values, options))
