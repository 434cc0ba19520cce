"""Explorers, in-process: controls are set as a reader would set them, the output area is read.

Every explorer: changing a control changes the output area, and what it shows is what the
package computes (``tpattn.run``, ``Config``, ``rope_angles``). Invalid or extreme values, and
random sequences of them (hypothesis), only ever produce a short message — never an ``error``
output, never a traceback. The static twins hold one panel per state, each showing that state.
"""
from __future__ import annotations

import base64
import io
import re
import subprocess
import sys
from xml.etree import ElementTree

import matplotlib.pyplot as plt
from matplotlib.backends.backend_agg import FigureCanvasAgg
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
import torch

import tpattn
from tpattn import widgets
from tpattn.viz.layers import (attention_heatmaps, attention_probabilities,
                               rope_rotation_figure, set_rope_position)
from tpattn.viz import heads as viz_heads
from tpattn.viz import sharding as viz_sharding
from tpattn.viz.sharding import measures_figure
from tpattn.viz.tables import format_measure, measures_table
from tpattn.widgets import explorers
from tpattn.widgets.explorers import MeasuresPlot, live_run


@pytest.fixture(autouse=True)
def no_figure_left_open():
    """An explorer closes every figure it makes, also when drawing fails (an open pyplot
    figure would be flushed into the reader's next cell by the inline backend)."""
    plt.close("all")
    yield
    assert plt.get_fignums() == [], "an explorer left a matplotlib figure open"


def texts(explorer) -> list[str]:
    """Every string in the output area (text/plain and text/html of each output)."""
    return [value for output in explorer.output.outputs
            for key, value in output.get("data", {}).items() if key.startswith("text/")]


def plain(explorer) -> str:
    return "\n".join(o["data"]["text/plain"] for o in explorer.output.outputs)


def svgs(explorer) -> list[str]:
    return [o["data"]["text/html"] for o in explorer.output.outputs
            if o["data"].get("text/html", "").startswith("<svg")]


def pngs(explorer) -> list[str]:
    return [o["data"]["image/png"] for o in explorer.output.outputs if "image/png" in o["data"]]


def assert_no_traceback(explorer) -> None:
    outputs = explorer.output.outputs
    assert outputs, "the output area is empty"
    assert all(o["output_type"] == "display_data" for o in outputs), outputs
    assert not any("Traceback" in t or 'File "' in t for t in texts(explorer)), texts(explorer)


def message(explorer) -> str:
    """The output area's one-line message (asserts there is exactly one output, a message)."""
    (output,) = explorer.output.outputs
    assert 'class="tpx-message"' in output["data"]["text/html"]
    return output["data"]["text/plain"]


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def figure_png(fig) -> bytes:
    """A full draw of ``fig`` at the explorers' dpi as PNG bytes (what a blit must equal)."""
    FigureCanvasAgg(fig)
    fig.set_dpi(widgets.core.PNG_DPI)
    fig.canvas.draw()
    png = widgets.core.encode_png(np.array(fig.canvas.buffer_rgba()))
    plt.close(fig)
    return png


# --- seed × mode ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def seed_mode():
    return widgets.seed_mode_explorer()


def test_seed_mode_starts_at_the_fixture(seed_mode):
    assert seed_mode.values == {"seed": 11, "mode": tpattn.EQUIVALENCE}
    assert plain(seed_mode).startswith(measures_table([tpattn.run(11, tpattn.EQUIVALENCE)]))
    assert "PASSED" in plain(seed_mode) and len(pngs(seed_mode)) == 1


@pytest.mark.parametrize("seed", tpattn.SEEDS)
@pytest.mark.parametrize("mode", tpattn.MODES)
def test_seed_mode_shows_what_run_computes(seed_mode, seed, mode):
    seed_mode.set(seed=seed, mode=mode)
    result = tpattn.run(seed, mode)
    (table, figure) = seed_mode.output.outputs
    assert table["data"]["text/plain"] == measures_table([result])
    html = table["data"]["text/html"]
    assert f"seed {seed}, mode <code>{mode}</code>" in html
    assert ("PASSED" if result["passed"] else "FAILED") in html
    assert result["passed"] == (mode == tpattn.EQUIVALENCE)
    for measure in tpattn.MEASURES:
        assert format_measure(result[measure]) in html
    assert figure["data"]["image/png"]


def test_seed_mode_changing_a_control_redraws(seed_mode):
    seed_mode.set(seed=11, mode=tpattn.EQUIVALENCE)
    before, count = seed_mode.output.outputs, seed_mode.redraws
    seed_mode.controls["mode"].value = tpattn.MISSING_OUTPUT_REDUCE  # as a click would
    assert seed_mode.redraws == count + 1
    assert seed_mode.output.outputs != before
    assert "FAILED" in plain(seed_mode) and pngs(seed_mode)[0] != before[1]["data"]["image/png"]


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64 + 5])
def test_seed_mode_invalid_seed_is_a_message(seed_mode, seed):
    seed_mode.set(seed=seed, mode=tpattn.EQUIVALENCE)
    with pytest.raises(ValueError) as raised:
        tpattn.run(seed, tpattn.EQUIVALENCE)
    assert message(seed_mode) == str(raised.value)
    seed_mode.set(seed=17)
    assert "PASSED" in plain(seed_mode)  # and it recovers


def test_live_run_remembers_each_state_apart():
    """``live_run`` serves every (seed, mode, cfg, simulate) its own result — visited in an
    order where a result served for the wrong state would differ from a fresh ``run`` — and
    a copy: changing what it returned does not change what it serves next."""
    sp = widgets.SP_EXPLORER_CONFIG
    states = [(11, tpattn.EQUIVALENCE, None, "fixture"), (17, tpattn.EQUIVALENCE, None, "fixture"),
              (11, tpattn.MISSING_OUTPUT_REDUCE, None, "fixture"),
              (11, tpattn.EQUIVALENCE, tpattn.Config(dtype="float64"), "fixture"),
              (11, tpattn.EQUIVALENCE, sp, "ranks"), (11, tpattn.EQUIVALENCE, sp, "fixture")]
    for _ in range(2):  # the second pass is served from memory
        for seed, mode, cfg, simulate in states:
            served = live_run(seed, mode, cfg, simulate)
            assert served == tpattn.run(seed, mode, cfg, simulate=simulate), (seed, mode, cfg)
    served["passed"] = "changed"
    assert live_run(*states[-1])["passed"] is True
    with pytest.raises(ValueError, match="seed must be"):
        live_run(-1, tpattn.EQUIVALENCE)


def test_attention_probabilities_are_remembered_per_layout_and_seed():
    """The remembered probabilities of one (cfg, seed) serve each batch element its own
    maps, never another layout's or seed's, and a caller cannot change them."""
    from tpattn.viz.layers import _batch_probabilities

    layouts = [explorers.attention_config(4, kv) for kv in (4, 2, 1)]
    for cfg in layouts + layouts[::-1]:
        for seed in (11, 17):
            fresh = _batch_probabilities.__wrapped__(cfg, seed)  # computed anew
            for batch_index in range(cfg.batch):
                served = attention_probabilities(cfg, seed, batch_index)
                assert torch.equal(served, fresh[batch_index]), (cfg, seed, batch_index)
    attention_probabilities(layouts[0], 11, 0).fill_(0)
    assert attention_probabilities(layouts[0], 11, 0).sum() > 0


def test_measures_plot_draws_exactly_measures_figure():
    """The partial redraw equals a full draw of ``measures_figure``, pixel for pixel —
    across results that move bars, change colors and zero floors (float64)."""
    plot = MeasuresPlot()
    f64 = tpattn.Config(dtype="float64")
    cases = [(11, tpattn.EQUIVALENCE, None), (11, tpattn.MISSING_OUTPUT_REDUCE, None),
             (11, tpattn.EQUIVALENCE, f64), (17, tpattn.MISSING_INPUT_GRAD_REDUCE, None)]
    for seed, mode, cfg in cases:
        result = tpattn.run(seed, mode, cfg)
        fast, full = plot.png(result), figure_png(measures_figure(result))
        assert np.array_equal(pixels(fast), pixels(full)), (seed, mode, cfg)
    assert plot.builds < len(cases)  # the fast path was taken


# --- sharding ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharding():
    return widgets.sharding_explorer()


def test_sharding_valid_layouts_draw_their_ranks(sharding):
    sharding.set(query_heads=4, kv_heads=2, world_size=2)
    first = plain(sharding)
    assert "rank 0: q0–q1 + kv0; rank 1: q2–q3 + kv1" in first and len(svgs(sharding)) == 1
    sharding.set(query_heads=8, kv_heads=8, world_size=4)
    assert "rank 3: q6–q7 + kv6–kv7" in plain(sharding) and plain(sharding) != first
    sharding.set(query_heads=8, kv_heads=2, world_size=4)  # fewer KV heads than ranks
    assert "kv0: ranks 0–1; kv1: ranks 2–3" in plain(sharding) and len(svgs(sharding)) == 1
    assert "replica group of kv1: ranks 2–3" in svgs(sharding)[0]


def test_kv_explorer_shows_replica_groups_costs_and_configs_messages():
    kv = widgets.kv_explorer()
    assert "kv0: ranks 0–1; kv1: ranks 2–3" in plain(kv) and len(svgs(kv)) == 1
    assert "gather_activations: holds 256 B of wk/wv, sends 960 B per step" in plain(kv)
    kv.set(kv_heads=1)
    assert "kv0: ranks 0–3" in plain(kv)
    kv.set(world_size=3)
    with pytest.raises(ValueError) as raised:
        tpattn.Config(query_heads=8, kv_heads=1, world_size=3)
    assert message(kv) == str(raised.value)
    static = widgets.kv_explorer(layouts=[(8, 2, 4), (8, 2, 3)]).static()
    assert len(static) == 4 and "invalid Config: " in static.html


@pytest.mark.parametrize("layout", [(8, 2, 3), (6, 4, 2), (0, 2, 2), (4, -1, 2), (4, 2, 0)])
def test_sharding_invalid_layout_shows_configs_own_message(sharding, layout):
    query_heads, kv_heads, world_size = layout
    sharding.set(query_heads=query_heads, kv_heads=kv_heads, world_size=world_size)
    with pytest.raises(ValueError) as raised:
        tpattn.Config(query_heads=query_heads, kv_heads=kv_heads, world_size=world_size)
    assert message(sharding) == str(raised.value)
    assert message(sharding).startswith("invalid Config: ")


def test_sharding_too_many_heads_to_draw_is_a_message(sharding):
    sharding.set(query_heads=10**6, kv_heads=10**6, world_size=10**6)
    assert message(sharding) == (f"query_heads: the figure draws at most "
                                 f"{explorers.MAX_DRAWN_HEADS} query heads (got 1000000)")


# --- RoPE and attention --------------------------------------------------------------------

def test_rope_redraws_at_the_new_position():
    rope = widgets.rope_explorer(position=3, head_dim=8)
    before = rope.output.outputs
    speeds = tpattn.block.layers.rope_angles(2, 8)[1, 0, 0].tolist()
    assert f"pair 1: {speeds[1]:.3g} rad/pos, at m=3 {3 * speeds[1]:.3g} rad" in plain(rope)
    rope.set(position=8)
    assert "at m=8" in plain(rope) and "4 pairs" in plain(rope)
    assert pngs(rope)[0] != before[1]["data"]["image/png"]
    rope.set(head_dim=4)
    assert "head_dim 4: 2 pairs" in plain(rope)


def test_attention_shows_the_kv_sharing_of_each_layout():
    attention = widgets.attention_explorer()
    assert "4 query heads read 2 KV head(s), 2 query heads per KV head" in plain(attention)
    gqa = pngs(attention)[0]
    attention.set(heads="MQA 4q/1kv")
    assert "read 1 KV head(s)" in plain(attention) and "= 25%" in plain(attention)
    assert pngs(attention)[0] != gqa
    attention.set(batch_index=5)
    assert message(attention) == "batch_index must be an integer in [0, 1] (got 5)"


def test_rope_moves_the_arrows_of_one_standing_figure():
    """A new position updates the standing figure (same ``Figure``, arrows at ``apply_rope``'s
    rotation) and shows exactly the pixels of a fresh ``rope_rotation_figure``."""
    rope = widgets.rope_explorer(position=3, head_dim=8)
    fig = rope.standing.figure((8, 16))
    assert fig is not None and rope.standing.builds == 1
    for position in (8, 0, 16):
        rope.set(position=position)
        assert rope.standing.figure((8, 16)) is fig and rope.standing.builds == 1
        assert fig.axes[0].get_title() == f"position m = {position}"
        unit = torch.zeros(position + 1, 1, 1, 8, dtype=torch.float64)
        unit[..., :4] = 1.0
        rotated = tpattn.block.layers.apply_rope(unit)[position, 0, 0]
        parts = fig.tpattn_rope  # the arrows' tips (set_rope_position), at apply_rope's pair
        for i in range(len(parts["arrows"])):
            assert (parts["cos"][position, i].item(), parts["sin"][position, i].item()) \
                == pytest.approx((rotated[i].item(), rotated[4 + i].item()), abs=1e-6)
        fresh = figure_png(rope_rotation_figure(position, head_dim=8, max_position=16))
        assert np.array_equal(pixels(base64.b64decode(pngs(rope)[0])), pixels(fresh)), position
    rope.set(head_dim=4)  # another structure: a second standing figure
    assert rope.standing.builds == 2 and rope.standing.figure((4, 16)) is not fig
    with pytest.raises(ValueError, match=r"position must be an integer in \[0, 16\] \(got 17\)"):
        set_rope_position(fig, 17)  # the slider stops at 16; the setter checks too


def test_attention_redraws_one_standing_figure_with_the_packages_probabilities():
    """A new seed or batch element updates the standing figure of its layout (same
    ``Figure``; images hold ``attention_probabilities``, future positions masked) and shows
    exactly the pixels of a fresh ``attention_heatmaps``; a bad value leaves it intact."""
    attention = widgets.attention_explorer()
    cfg = explorers.attention_config(*explorers.ATTENTION_LAYOUTS["GQA 4q/2kv"])
    fig = attention.standing.figure(cfg)
    for seed, batch_index in ((17, 0), (123, 1)):
        attention.set(seed=seed, batch_index=batch_index)
        assert attention.standing.figure(cfg) is fig and attention.standing.builds == 1
        probs = attention_probabilities(cfg, seed, batch_index).double()
        future = tpattn.block.layers.causal_mask(cfg.seq)
        for h, image in enumerate(fig.tpattn_attention["images"]):
            shown = np.asarray(image.get_array().filled(np.nan))
            expected = probs[h].masked_fill(future, float("nan")).numpy()
            assert np.array_equal(shown, expected, equal_nan=True)
        assert fig.tpattn_attention["state"].get_text() == f"seed {seed}, batch {batch_index}"
        assert fig.get_suptitle() == "Causal attention: 4 query heads share 2 KV heads"
        fresh = figure_png(attention_heatmaps(cfg, seed, batch_index))
        assert np.array_equal(pixels(base64.b64decode(pngs(attention)[0])), pixels(fresh))
    attention.set(batch_index=2)
    assert message(attention) == "batch_index must be an integer in [0, 1] (got 2)"
    attention.set(seed=5, batch_index=0)
    fresh = figure_png(attention_heatmaps(cfg, 5, 0))
    assert np.array_equal(pixels(base64.b64decode(pngs(attention)[0])), pixels(fresh))


def _svg_parts(svg: str) -> dict:
    """What an SVG heads picture draws: its filled rects' colors, its lines (dashed or not)
    and its texts (each ``<text>``'s lines joined by a space)."""
    root = ElementTree.fromstring(svg)
    ns = ""  # inline SVG in HTML: no namespace
    return {"fills": [r.get("fill") for r in root.iter(ns + "rect")],
            "lines": [bool(line.get("stroke-dasharray")) for line in root.iter(ns + "line")],
            "texts": [" ".join(t.text for t in text.iter(ns + "tspan"))
                      for text in root.iter(ns + "text")]}


#: Layouts the heads pictures are checked on: both kinds, split groups, 2 to 32 heads.
PICTURE_LAYOUTS = [(4, 2, 2, None), (8, 8, 4, None), (32, 8, 4, None), (8, 2, 4, None),
                   (16, 2, 8, "gather_activations"), (8, 1, 4, None), (6, 3, 3, None)]


@pytest.mark.parametrize("query_heads, kv_heads, world_size, strategy", PICTURE_LAYOUTS)
def test_svg_and_figure_draw_the_layouts_boxes_lines_labels_and_legend(
        query_heads, kv_heads, world_size, strategy):
    """The explorers' SVG and the chapters' matplotlib figure draw one description
    (``HeadsPicture``): every head's box in its rank's color and its label, one line per query
    head (dashed where it crosses ranks), the replica groups, the legend and the title."""

    cfg = tpattn.Config(query_heads=query_heads, kv_heads=kv_heads, world_size=world_size,
                        **({"kv_strategy": strategy} if strategy else {}))
    picture = viz_heads.heads_picture(cfg)
    parts = _svg_parts(viz_heads.heads_svg(picture))
    labels = [box[5].replace("\n", " ") for box in picture.boxes]
    ranks = [f"rank {r}" for r in range(picture.ranks)]
    assert parts["texts"][:2] == [" ".join(label.split()) for label, _ in picture.rows]
    assert parts["texts"][2:] == ([g[4] for g in picture.groups] + labels + ranks
                                  + [f"{picture.title} {picture.subtitle}"])
    assert f"{query_heads} query heads, {kv_heads} KV heads, {world_size} ranks" in picture.title
    assert parts["fills"] == (["white"] + ["none"] * len(picture.groups)
                              + [box[4] for box in picture.boxes]
                              + [viz_sharding.rank_color(r) for r in range(picture.ranks)])
    assert parts["lines"] == [line[5] for line in picture.lines] and len(parts["lines"]) == query_heads
    owner = [h // cfg.local_query_heads for h in range(query_heads)]
    assert [box[4] for box in picture.boxes[:query_heads]] == [
        viz_sharding.rank_color(r) for r in owner]  # query head h on its rank's color
    fig = viz_sharding.heads_to_ranks_figure(cfg)
    ax = fig.axes[0]
    shown = [t.get_text().replace("\n", " ") for t in ax.texts]
    assert shown[:2] == [" ".join(label.split()) for label, _ in picture.rows]
    assert sorted(shown[2:]) == sorted(labels + [g[4] for g in picture.groups])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ranks
    assert ax.get_title() == f"{picture.title}\n{picture.subtitle}"
    assert len(ax.patches) == len(picture.boxes) + len(picture.groups)
    plt.close(fig)


def test_a_split_group_is_dashed_in_the_fail_color():
    """Round-robin query heads (chapter 6) put query heads on another rank than their KV
    head: those lines, and only those, are dashed in the fail color; the title counts them."""
    cfg = tpattn.Config()
    round_robin = [h % cfg.world_size for h in range(cfg.query_heads)]
    picture = viz_heads.heads_layout(cfg, query_ranks=round_robin)
    crossing = [round_robin[h] != (h // cfg.group_size) // cfg.local_kv_heads
                for h in range(cfg.query_heads)]
    assert [line[5] for line in picture.lines] == crossing and any(crossing)
    assert all(line[4] == viz_sharding.FAIL_COLOR for line in picture.lines if line[5])
    assert picture.subtitle == f"{sum(crossing)} query head(s) on another rank than their KV head"
    assert viz_heads.heads_layout(cfg).subtitle == "every rank holds complete query/KV groups"
    with pytest.raises(ValueError, match=r"query_ranks must give a rank in \[0, 2\)"):
        viz_heads.heads_layout(cfg, query_ranks=[0, 1, 2, 0])


def test_the_explorers_show_the_svg_of_the_layout_live_and_static():
    """The live output area and the static twin's panel hold the same SVG, that of
    ``heads_svg(heads_picture(cfg))``, for a layout of each kind."""

    for layout in ((4, 2, 2), (8, 2, 4)):
        cfg = tpattn.Config(**dict(zip(("query_heads", "kv_heads", "world_size"), layout)))
        sharding = widgets.sharding_explorer(*layout, layouts=[layout])
        (svg,) = svgs(sharding)
        assert svg == viz_heads.heads_svg(viz_heads.heads_picture(cfg))
        assert svg in sharding.static_html()
    kv = widgets.kv_explorer(8, 2, 4, "gather_activations", layouts=[(8, 2, 4)])
    static = kv.static()
    assert "rows 0–1" in svgs(kv)[0] and svgs(kv)[0] in static.panels[0, 1]
    assert static.initial == (0, 1)  # it opens on the live explorer's state


def test_a_layout_shown_again_shows_its_own_outputs():
    """The explorers keep the outputs of the layouts shown last: going back to a layout
    shows exactly what a fresh explorer shows for it, never the previous layout's."""
    for make, first, second in (
            (widgets.sharding_explorer, dict(query_heads=4, kv_heads=2, world_size=2),
             dict(query_heads=4, kv_heads=4, world_size=4)),
            (widgets.kv_explorer, dict(query_heads=8, kv_heads=2, world_size=4),
             dict(query_heads=8, kv_heads=2, world_size=4, kv_strategy="gather_activations"))):
        explorer = make(**first)
        shown_first = explorer.output.outputs
        explorer.set(**second)
        shown_second = explorer.output.outputs
        assert shown_second != shown_first
        explorer.set(**{**{k: v for k, v in first.items()}, "kv_strategy": "replicate_weights"}
                     if make is widgets.kv_explorer else first)
        assert explorer.output.outputs == shown_first
        assert explorer.shown.cache_info().hits >= 1
        assert tuple(make(**second).output.outputs) == tuple(shown_second)


# --- random sequences: never a traceback ---------------------------------------------------

INTS = st.one_of(st.integers(-3, 12), st.integers(-(2**70), 2**70))


@pytest.fixture
def cheap_figures(monkeypatch):
    """Hypothesis needs many draws: build each figure (where bad shapes would raise), skip
    rasterizing it (~0.3 s here, and not where a traceback would come from)."""
    def build_only(standing, structure, state):
        plt.close(standing.build(structure, state))
        return np.zeros((2, 2, 4), dtype=np.uint8)

    monkeypatch.setattr(widgets.core.StandingFigure, "pixels", build_only)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.sampled_from(["query_heads", "kv_heads", "world_size"]), INTS),
                      min_size=1, max_size=4))
def test_sharding_random_values_never_show_a_traceback(sharding, cheap_figures, steps):
    for name, value in steps:
        sharding.controls[name].value = value
        assert_no_traceback(sharding)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.one_of(st.tuples(st.just("seed"), INTS),
                                st.tuples(st.just("mode"), st.sampled_from(tpattn.MODES))),
                      min_size=1, max_size=4))
def test_seed_mode_random_values_never_show_a_traceback(seed_mode, steps):
    for name, value in steps:
        seed_mode.controls[name].value = value
        assert_no_traceback(seed_mode)
        seed, mode = seed_mode.values["seed"], seed_mode.values["mode"]
        if 0 <= seed < 2**63 - 100:
            assert f"seed {seed}, mode <code>{mode}</code>" in seed_mode.output.outputs[0][
                "data"]["text/html"]


def test_an_unexpected_failure_is_a_message_too():
    def broken(**_):
        plt.figure()  # left open by the failure: the explorer must close it
        raise RuntimeError("shape '[5, 2, -1, 4]' is invalid for input of size 7")

    explorer = widgets.Explorer("broken", {"seed": widgets.seed_control()}, broken)
    assert message(explorer) == ("cannot draw this: RuntimeError: shape '[5, 2, -1, 4]' is "
                                 "invalid for input of size 7")


# --- the static twins and the displayed bundle ---------------------------------------------

def panels(static) -> dict[str, str]:
    """Panel id → its HTML, from the static explorer's markup."""
    found = re.findall(r'<div class="tpx-panel" id="([^"]+)"[^>]*>(.*?)</div>\n(?=<div class="tpx-panel"|</div>)',
                       static.html, flags=re.S)
    return dict(found)


def test_static_seed_mode_has_one_panel_per_state_showing_it():
    seeds = (11, 29)  # the book's default is all five: 15 panels, the same code
    static = widgets.seed_mode_explorer(seeds=seeds).static()
    shown = panels(static)
    assert len(static) == len(shown) == len(seeds) * len(tpattn.MODES)
    for i, seed in enumerate(seeds):
        for j, mode in enumerate(tpattn.MODES):
            body = shown[f"{static.prefix}-p{i}-{j}"]
            result = tpattn.run(seed, mode)
            assert f"seed {seed}, mode <code>{mode}</code>" in body
            assert ("PASSED" if result["passed"] else "FAILED") in body
            assert all(format_measure(result[m]) in body for m in tpattn.MEASURES)
            assert body.count("data:image/png;base64,") == 1
            # CSS shows it exactly when seed i and mode j are checked
            assert (f"#{static.prefix}-g0-{i}:checked ~ #{static.prefix}-g1-{j}:checked ~ "
                    f".tpx-panels > #{static.prefix}-p{i}-{j} {{ display: block; }}") in static.html
    assert 'id="%s-g0-0" style="position:absolute;opacity:0;width:0;height:0;margin:0" checked' \
        % static.prefix in static.html  # seed 11 …
    assert 'id="%s-g1-0" style="position:absolute;opacity:0;width:0;height:0;margin:0" checked' \
        % static.prefix in static.html  # … equivalence, selected at first


def test_static_sharding_shows_the_invalid_layouts_message_and_is_deterministic():
    layouts = ((4, 2, 2), (8, 2, 3))
    static = widgets.sharding_explorer(layouts=layouts).static()
    again = widgets.sharding_explorer(layouts=layouts).static()
    assert static.html == again.html  # the same bytes every build (nbval compares them)
    shown = panels(static)
    assert "rank 1: q2–q3 + kv1" in shown[f"{static.prefix}-p0"]
    assert "world_size must be a multiple of kv_heads" in shown[f"{static.prefix}-p1"]
    assert "<script" not in static.html and "http" not in static.html  # self-contained


def test_static_rope_and_attention_hold_their_states(monkeypatch, cheap_figures):
    monkeypatch.setattr(explorers, "ROPE_POSITIONS", (0, 5))
    rope = widgets.rope_explorer(position=5).static()
    assert len(rope) == 2 and "at m=5" in panels(rope)[f"{rope.prefix}-p1"]
    assert rope.initial == (1,) and "at m=0" in panels(rope)[f"{rope.prefix}-p0"]
    attention = widgets.attention_explorer(seed=17, heads="MQA 4q/1kv").static()
    assert len(attention) == len(explorers.ATTENTION_LAYOUTS) * len(explorers.ATTENTION_SEEDS)
    assert attention.initial == (2, 1)
    for i, (q, kv) in enumerate(explorers.ATTENTION_LAYOUTS.values()):
        for j, seed in enumerate(explorers.ATTENTION_SEEDS):
            body = panels(attention)[f"{attention.prefix}-p{i}-{j}"]
            assert f"{q} query heads read {kv} KV head(s)" in body and f"seed {seed}" in body


def test_displayed_explorer_carries_live_widget_and_static_twin(monkeypatch, cheap_figures):
    monkeypatch.setattr(explorers, "SHARDING_LAYOUTS", ((4, 2, 2), (8, 2, 4)))
    sharding = widgets.sharding_explorer()
    bundle = sharding._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == sharding.widget.model_id
    assert bundle["text/html"] == sharding.static_html()
    assert bundle["text/html"].startswith('<div class="tpx" id="tpx-sharding-')
    assert bundle["text/plain"] == "<sharding explorer: query_heads, kv_heads, world_size>"


def test_import_tpattn_does_not_load_widgets():
    code = ("import sys, tpattn; heavy = [m for m in ('ipywidgets', 'matplotlib', "
            "'tpattn.widgets') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_live_and_static_share_the_standing_figure_they_open_on():
    rope = widgets.rope_explorer(position=3)
    fig = rope.standing.figure((8, 16))
    assert fig is not None and rope.standing.builds == 1
    html = rope.static_html()
    assert rope.standing.figure((8, 16)) is fig  # the static panels were drawn on it
    assert rope.standing.builds == len(rope.controls["head_dim"].options)  # one per head_dim
    assert html.count("data:image/png;base64,") == len(explorers.ROPE_POSITIONS)


@pytest.mark.parametrize("shape", [(1, 1, 4), (7, 5, 3), (260, 880, 4)])
def test_encode_png_holds_exactly_the_pixels(shape):
    """The live PNG (hand-made chunks) decodes, with PIL, to exactly the pixels given (RGB);
    the palette PNG of a figure's few colors to each within 2 levels (the octree keeps a
    mean per color: 255 comes back as 254)."""
    rng = np.random.default_rng(sum(shape))
    array = rng.integers(0, 256, size=shape, dtype=np.uint8)
    assert np.array_equal(pixels(widgets.core.encode_png(array)), array[..., :3])
    few = np.array([[0, 0, 0], [255, 255, 255], [31, 119, 180]], np.uint8)[
        rng.integers(0, 3, size=shape[:2])]
    back = pixels(widgets.core.encode_png(few, palette=True)).astype(int)
    assert np.abs(back - few).max() <= 2
