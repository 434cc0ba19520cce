"""Figures for Part I, the dense block (chapters 2–5): RMSNorm, RoPE, attention, the step."""
from __future__ import annotations

import functools
import math

import matplotlib.pyplot as plt
import torch
from matplotlib.collections import PathCollection
from matplotlib.patches import FancyArrowPatch
from matplotlib.path import Path
from matplotlib.textpath import TextPath
from matplotlib.transforms import Affine2D
from matplotlib.ticker import MaxNLocator

from tpattn.check.core import PARAM_SEED_OFFSET, check_int, check_seed, make_inputs
from tpattn.config import Config
from tpattn.block.dense import project_qkv
from tpattn.block.layers import apply_rope, attention_probs, causal_mask, repeat_kv, rms_norm, rope_angles
from tpattn.block.params import PARAM_NAMES, init_params
from .style import DENSE_COLOR, new_figure

__all__ = ["KV_HEAD_COLORS", "kv_head_color", "token_rms_figure", "rope_rotation_figure",
           "set_rope_position", "rope_dynamic_artists", "rope_relative_position_figure",
           "attention_heatmaps", "attention_probabilities", "set_attention_state",
           "attention_dynamic_artists", "gradient_figure"]

#: One color per KV head (Dark2; a KV head is not a rank, so not ``RANK_COLORS``).
KV_HEAD_COLORS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"]


def kv_head_color(kv_head: int) -> str:
    """The frame color of KV head ``kv_head`` and of the query heads that read it."""
    return KV_HEAD_COLORS[kv_head % len(KV_HEAD_COLORS)]


def token_rms_figure(x: torch.Tensor, normalized: torch.Tensor):
    """Per-token RMS of ``x`` and ``normalized`` (``[S, B, hidden]``), a dashed line at 1."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a tensor [S, B, hidden] (got shape {getattr(x, 'shape', None)})")
    if not isinstance(normalized, torch.Tensor) or normalized.shape != x.shape:
        raise ValueError(f"normalized must have the shape of x {tuple(x.shape)} "
                         f"(got {tuple(getattr(normalized, 'shape', ()))})")
    seq, batch = x.shape[0], x.shape[1]
    rms_before, rms_after = (t.detach().double().pow(2).mean(-1).sqrt().T.reshape(-1)
                             for t in (x, normalized))  # batch-major order
    fig, ax = new_figure(figsize=(7.0, 3.0))
    pos = torch.arange(seq * batch, dtype=torch.float64)
    ax.bar(pos - 0.2, rms_before, width=0.4, color="#bbbbbb", label="x (before)")
    ax.bar(pos + 0.2, rms_after, width=0.4, color=DENSE_COLOR, label="RMSNorm(x) (after)")
    ax.axhline(1.0, color="k", ls="--", lw=0.8)
    ax.set_xticks(pos.tolist(), [f"s{s}\nb{b}" for b in range(batch) for s in range(seq)], fontsize=8)
    ax.set(xlabel="token (position s, batch b)", ylabel="RMS over hidden",
           title="Every token leaves RMSNorm with RMS 1",
           ylim=(0, 1.3 * max(rms_before.max().item(), 1.0)))
    ax.legend(loc="upper center", ncol=2, fontsize=8, frameon=False)
    return fig


def rope_rotation_figure(position: int, head_dim: int = 8, max_position: int = 16):
    """Every channel pair of a unit vector turned by ``apply_rope`` to ``position``: arrows
    on the unit circle (left), each pair's angle against position (right)."""
    check_int("max_position", max_position, 1)
    check_int("position", position, 0, max_position)
    check_int("head_dim", head_dim, 2)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE's channel pairs (got {head_dim})")
    half = head_dim // 2
    unit = torch.zeros(max_position + 1, 1, 1, head_dim, dtype=torch.float64)
    unit[..., :half] = 1.0
    rotated = apply_rope(unit)[:, 0, 0]                       # [P, D]
    cos, sin = rotated[:, :half], rotated[:, half:]           # [P, half] each
    wrapped = torch.atan2(sin, cos)                           # angle in (-pi, pi]
    freqs = rope_angles(2, head_dim, dtype=torch.float64)[1, 0, 0]  # angle per position step
    colors = plt.get_cmap("viridis")(torch.linspace(0.0, 0.9, half).tolist())
    fig, (circle, angles) = new_figure(2, figsize=(8.0, 3.6), width_ratios=[1, 1.4])
    t = torch.linspace(0, 2 * math.pi, 200)
    circle.plot(t.cos(), t.sin(), color="#cccccc", lw=1)
    arrows = []
    for i in range(half):
        circle.plot(cos[:, i], sin[:, i], ls="none", marker=".", ms=3, color=colors[i], alpha=0.35)
        arrows.append(circle.add_patch(FancyArrowPatch(
            (0.0, 0.0), (1.0, 0.0), arrowstyle="-|>", color=colors[i], lw=1.8,
            mutation_scale=10, zorder=3)))
        label = f"pair {i}: {freqs[i].item():.3g} rad/pos"
        angles.plot(range(max_position + 1), wrapped[:, i], marker=".", ms=4, lw=1,
                    color=colors[i], label=label if half <= 8 else None)
    circle.set(aspect="equal", xlim=(-1.15, 1.15), ylim=(-1.15, 1.15), xlabel=r"channel $i$",
               ylabel=r"channel $i + D/2$")
    cursor = angles.axvline(0, color="k", ls="--", lw=0.8)
    angles.set_ylim(-math.pi - 0.2, math.pi + 0.2)
    angles.set_yticks([-math.pi, 0, math.pi], [r"$-\pi$", "0", r"$\pi$"])
    angles.set(xlabel="position m", ylabel="angle of the pair (wrapped)",
               title=f"{half} pairs, {half} frequencies (head_dim {head_dim})")
    if half <= 8:
        angles.legend(fontsize=7, frameon=False, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tpattn_rope = {"cos": cos, "sin": sin, "arrows": arrows, "cursor": cursor,
                       "max_position": max_position}
    set_rope_position(fig, position)
    return fig


def set_rope_position(fig, position: int) -> None:
    """Move a ``rope_rotation_figure`` to ``position``: its arrows, cursor and title."""
    parts = fig.tpattn_rope
    check_int("position", position, 0, parts["max_position"])
    for i, arrow in enumerate(parts["arrows"]):
        arrow.set_positions(None, (parts["cos"][position, i].item(),
                                   parts["sin"][position, i].item()))
    parts["cursor"].set_xdata([position, position])
    fig.axes[0].set_title(f"position m = {position}")


def rope_dynamic_artists(fig) -> list:
    """The artists ``set_rope_position`` changes, with those drawn over them, in z order."""
    circle, angles = fig.axes[:2]
    parts = fig.tpattn_rope
    return [parts["cursor"], *angles.spines.values(), *circle.spines.values(),
            *parts["arrows"], circle.title]


def rope_relative_position_figure(scores: torch.Tensor):
    """Heat map of ``scores[m, n]`` ``[M, N]`` (``RoPE(q)_m · RoPE(k)_n``)."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        raise ValueError(f"scores must be a tensor [M, N] (got shape {getattr(scores, 'shape', None)})")
    fig, ax = new_figure(figsize=(4.6, 3.8))
    im = ax.imshow(scores.detach().double().numpy(), cmap="RdBu_r", origin="upper",
                   vmin=-scores.abs().max().item(), vmax=scores.abs().max().item())
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="key position n", ylabel="query position m",
           title=r"$\mathrm{RoPE}(q)_m \cdot \mathrm{RoPE}(k)_n$: constant along diagonals")
    fig.colorbar(im, ax=ax, shrink=0.85)
    return fig


def attention_heatmaps(cfg: Config, seed: int, batch_index: int = 0):
    """``attention_probabilities``: a panel per query head, framed in its KV head's color."""
    if not isinstance(cfg, Config):
        raise ValueError(f"cfg must be a tpattn.Config (got {type(cfg).__name__})")
    probs = attention_probabilities(cfg, seed, batch_index)
    heads = cfg.query_heads
    ncols = min(heads, 8)
    nrows = math.ceil(heads / ncols)
    panel = 2.0 if cfg.seq <= 16 else 1.6
    fig, axes = new_figure(ncols, nrows, figsize=(panel * ncols + 0.8, panel * nrows + 0.6),
                           squeeze=False)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#eeeeee")
    im, images, values = None, [], []
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.set_visible(False)
            continue
        kv = h // cfg.group_size
        im = ax.imshow(torch.zeros(cfg.seq, cfg.seq).numpy(), vmin=0.0, vmax=1.0, cmap=cmap)
        images.append(im)
        if cfg.seq <= 6:
            values.append(ax.add_collection(PathCollection(  # the cells' values: one artist
                [], offsets=[(t, s) for s in range(cfg.seq) for t in range(s + 1)],
                offset_transform=ax.transData, edgecolors="none", zorder=3,
                transform=Affine2D().scale(1 / 72) + fig.dpi_scale_trans), autolim=False))
        ax.set_title(f"q head {h} → KV head {kv}", fontsize=9, color=kv_head_color(kv))
        for spine in ax.spines.values():
            spine.set(visible=True, color=kv_head_color(kv), linewidth=3)
        ax.set(xticks=[], yticks=[])
        if h % ncols == 0:
            ax.set_ylabel("query position")
        if h // ncols == nrows - 1:
            ax.set_xlabel("key position")
    fig.colorbar(im, ax=axes, shrink=0.8, label="probability")
    fig.suptitle(f"Causal attention: {cfg.query_heads} query heads share {cfg.kv_heads} KV "
                 f"heads", fontsize=10)
    # the state: a short text of its own, so that a live update lays out only it
    state = fig.text(0.01, 0.98, " ", ha="left", va="top", fontsize=10)
    fig.tpattn_attention = {"cfg": cfg, "images": images, "values": values, "state": state}
    set_attention_state(fig, seed, batch_index, probs)
    return fig


def attention_probabilities(cfg: Config, seed: int, batch_index: int = 0) -> torch.Tensor:
    """``[Hq, S, S]`` causal attention probabilities of batch element ``batch_index``."""
    check_seed(seed)
    check_int("batch_index", batch_index, 0, cfg.batch - 1)
    return _batch_probabilities(cfg, seed)[batch_index].clone()


@functools.lru_cache(maxsize=64)
def _batch_probabilities(cfg: Config, seed: int) -> torch.Tensor:
    """``[B, Hq, S, S]`` probabilities of ``(cfg, seed)``; cached: never modify it."""
    x, _ = make_inputs(cfg, seed)
    p = init_params(cfg, seed + PARAM_SEED_OFFSET)
    with torch.no_grad():
        n = rms_norm(x, p["norm"], cfg.eps)
        q, k, _ = project_qkv(n, p["wq"], p["wk"], p["wv"], cfg.head_dim)
        return attention_probs(q, repeat_kv(k, cfg.group_size))  # [B, Hq, S, S]


@functools.lru_cache(maxsize=256)
def _value_path(text: str) -> Path:
    """``text`` as a 6.5-point glyph outline centered on the origin (a cell's value)."""
    path = TextPath((0, 0), text, size=6.5)
    box = path.get_extents()
    return Path(path.vertices - [(box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2], path.codes)


def set_attention_state(fig, seed: int, batch_index: int = 0,
                        probs: torch.Tensor | None = None) -> None:
    """Redraw an ``attention_heatmaps`` figure for ``seed``, ``batch_index`` (or ``probs``)."""
    parts = fig.tpattn_attention
    cfg = parts["cfg"]
    if probs is None:
        probs = attention_probabilities(cfg, seed, batch_index)
    future = causal_mask(cfg.seq)
    for h, im in enumerate(parts["images"]):
        im.set_data(probs[h].double().masked_fill(future, float("nan")).numpy())  # masked: grey
    cells = [(s, t) for s in range(cfg.seq) for t in range(s + 1)]
    listed = probs.tolist() if parts["values"] else None  # [Hq][S][S] floats, one call
    for h, labels in enumerate(parts["values"]):
        shown = [listed[h][s][t] for s, t in cells]
        labels.set_paths([_value_path(f"{v:.2f}") for v in shown])
        labels.set_facecolor(["k" if v > 0.6 else "w" for v in shown])
    parts["state"].set_text(f"seed {seed}, batch {batch_index}")


def attention_dynamic_artists(fig) -> list:
    """The artists ``set_attention_state`` changes, with those drawn over them, in z order."""
    parts = fig.tpattn_attention
    artists = []
    for h, im in enumerate(parts["images"]):
        artists += [im, *im.axes.spines.values(), *parts["values"][h:h + 1]]
    return artists + [parts["state"]]


def gradient_figure(grads: dict[str, torch.Tensor]):
    """A panel per parameter gradient: ``norm`` as bars, the matrices as heat maps, with norms."""
    if not isinstance(grads, dict) or set(grads) != set(PARAM_NAMES):
        raise ValueError(f"grads must be a dict with keys {list(PARAM_NAMES)} "
                         f"(got {sorted(grads) if isinstance(grads, dict) else type(grads).__name__})")
    fig, axes = new_figure(len(PARAM_NAMES), figsize=(10.0, 3.0), width_ratios=[1.4, 1, 1, 1, 1.6])
    for ax, name in zip(axes, PARAM_NAMES):
        g = grads[name].detach().double()
        lim = max(g.abs().max().item(), 1e-12)
        title = f"{name}  ‖g‖={g.norm().item():.3f}"
        if g.dim() == 1:
            ax.bar(range(g.numel()), g.numpy(), color=DENSE_COLOR)
            ax.axhline(0, color="k", lw=0.6)
            ax.set_xlabel("hidden channel")
        else:
            im = ax.imshow(g.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
            ax.set(xlabel="in", ylabel="out")
            fig.colorbar(im, ax=ax, shrink=0.8)
        ax.set_title(title, fontsize=9)
    return fig
