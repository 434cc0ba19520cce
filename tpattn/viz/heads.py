"""Heads pictures (chapters 6 and 13): which rank holds which query and KV heads, as a
``HeadsPicture`` drawn by ``draw_heads`` (matplotlib) or ``heads_svg`` (an SVG string)."""
from __future__ import annotations

import html
from typing import NamedTuple, Sequence

import matplotlib.patches as mpatches
from matplotlib.collections import LineCollection

from tpattn.config import Config
from tpattn.parallel.kv_heads import (GATHER_ACTIVATIONS, has_replicas, kv_head_of_rank,
                                      kv_weight_rows, replica_groups)
from .style import FAIL_COLOR, bare_axes, new_figure, rank_color, side_legend

__all__ = ["HEADS_MARGINS", "HeadsPicture", "frame_position", "draw_heads", "heads_svg",
           "heads_picture", "heads_layout", "replica_groups_layout"]

#: Margins of a heads frame in inches (left, bottom, right, top): title above, legend right.
HEADS_MARGINS = (3 / 72, 3 / 72, 0.92, 0.44)
_LABEL_CHAR_PT = 5.4


class HeadsPicture(NamedTuple):
    """A heads figure of ``size`` inches, data limits ``xlim``, ``ylim``; ``rows``: ``(label,
    y)``; lines ``(x0, y0, x1, y1, color, dashed, width)``; boxes ``(x, y, w, h, color, label,
    fontsize)`` centered; groups: dashed frames ``(left, bottom, w, h, label)``; ``ranks``
    in the legend."""

    size: tuple[float, float]
    xlim: tuple[float, float]
    ylim: tuple[float, float]
    rows: tuple
    title: str
    subtitle: str
    title_color: str
    lines: tuple
    boxes: tuple
    groups: tuple
    ranks: int


def frame_position(picture: HeadsPicture) -> tuple[float, float, float, float]:
    """The axes' ``(left, bottom, width, height)`` in inches, widened left for the row labels."""
    (left, bottom, right, top), (fig_w, fig_h), xlim = HEADS_MARGINS, picture.size, picture.xlim
    span, room = xlim[1] - xlim[0], -0.9 - xlim[0]  # data units: all, left of the labels
    widest = max(len(line) for label, _ in picture.rows for line in label.split("\n"))
    widest = widest * _LABEL_CHAR_PT / 72
    inches = fig_w - left - right
    if widest > room * inches / span:  # move the axes right until the labels fit
        left += (widest * span - room * inches) / (span - room)
    return left, bottom, fig_w - left - right, fig_h - bottom - top


def draw_heads(picture: HeadsPicture):
    """``picture`` as a new matplotlib figure (one ``Axes``, no axis)."""
    (fig_w, fig_h), (left, bottom, width, height) = picture.size, frame_position(picture)
    fig, ax = new_figure(figsize=picture.size, layout=None)
    ax.set_position([left / fig_w, bottom / fig_h, width / fig_w, height / fig_h])
    for label, y in picture.rows:
        ax.text(-0.9, y, label, ha="right", va="center", fontsize=9)
    bare_axes(ax, picture.xlim, picture.ylim)
    ax.add_collection(LineCollection(
        [[(x0, y0), (x1, y1)] for x0, y0, x1, y1, *_ in picture.lines],
        colors=[line[4] for line in picture.lines], zorder=1,
        linestyles=["--" if line[5] else "-" for line in picture.lines],
        linewidths=[line[6] for line in picture.lines]), autolim=False)
    for x, y, width, height, color, label, fontsize in picture.boxes:
        ax.add_patch(mpatches.FancyBboxPatch(
            (x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.02",
            facecolor=color, edgecolor="white", zorder=2))
        ax.text(x, y, label, ha="center", va="center", color="white", fontweight="bold",
                fontsize=fontsize, zorder=3)
    for left, bottom, width, height, label in picture.groups:
        ax.add_patch(mpatches.Rectangle((left, bottom), width, height, fill=False,
                                        edgecolor="#333333", linestyle="--", linewidth=1.1,
                                        zorder=1))
        ax.text(left + width / 2, bottom - 0.14, label, ha="center", va="top", fontsize=8)
    side_legend(ax, handles=[mpatches.Patch(color=rank_color(r), label=f"rank {r}")
                             for r in range(picture.ranks)])
    ax.set_title(f"{picture.title}\n{picture.subtitle}", color=picture.title_color)
    return fig


def _svg_text(x, y, text, size, anchor="middle", **attributes) -> str:
    """One ``<text>`` (a multi-line ``text``: one ``<tspan>`` per line, centered on ``y``)."""
    lines = text.split("\n")
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attributes.items())
    spans = "".join(f'<tspan x="{x:.1f}" dy="{(1.2 if i else 0.35 - 0.6 * (len(lines) - 1)):.2f}em">'
                    f"{html.escape(line)}</tspan>" for i, line in enumerate(lines))
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" '
            f'text-anchor="{anchor}"{extra}>{spans}</text>')


def heads_svg(picture: HeadsPicture, dpi: int = 100) -> str:
    """``picture`` as an inline ``<svg>`` of ``draw_heads``'s PNG size at ``dpi``."""
    (fig_w, fig_h), (x0, x1), (y0, y1) = picture.size, picture.xlim, picture.ylim
    left, bottom, width, height = (72 * v for v in frame_position(picture))
    top = 72 * fig_h - bottom - height
    sx, sy = width / (x1 - x0), height / (y1 - y0)
    px = lambda x: left + (x - x0) * sx  # noqa: E731 — data to points
    py = lambda y: top + (y1 - y) * sy  # noqa: E731
    out = [f'<svg class="tpx-heads" role="img" '
           f'width="{fig_w * dpi:.0f}" height="{fig_h * dpi:.0f}" '
           f'viewBox="0 0 {72 * fig_w:.1f} {72 * fig_h:.1f}" '
           f'style="max-width:100%;height:auto;font-family:DejaVu Sans,Verdana,sans-serif">',
           f"<title>{html.escape(picture.title)}: {html.escape(picture.subtitle)}</title>",
           f'<rect width="100%" height="100%" fill="white"/>']
    for label, y in picture.rows:
        out.append(_svg_text(px(-0.9), py(y), label, 9, "end"))
    for lx0, ly0, lx1, ly1, color, dashed, lw in picture.lines:
        dash = ' stroke-dasharray="5.9,2.6"' if dashed else ""
        out.append(f'<line x1="{px(lx0):.1f}" y1="{py(ly0):.1f}" x2="{px(lx1):.1f}" '
                   f'y2="{py(ly1):.1f}" stroke="{color}" stroke-width="{lw}"{dash}/>')
    for left_, bottom_, w, h, label in picture.groups:
        out.append(f'<rect x="{px(left_):.1f}" y="{py(bottom_ + h):.1f}" width="{w * sx:.1f}" '
                   f'height="{h * sy:.1f}" fill="none" stroke="#333333" stroke-width="1.1" '
                   f'stroke-dasharray="4.1,1.8"/>')
        out.append(_svg_text(px(left_ + w / 2), py(bottom_ - 0.14) + 5, label, 8))
    for x, y, w, h, color, label, size in picture.boxes:
        pad = 0.02
        out.append(f'<rect x="{px(x - w / 2 - pad):.1f}" y="{py(y + h / 2 + pad):.1f}" '
                   f'width="{(w + 2 * pad) * sx:.1f}" height="{(h + 2 * pad) * sy:.1f}" '
                   f'rx="{2 * pad * sx:.1f}" fill="{color}" stroke="white"/>')
        out.append(_svg_text(px(x), py(y), label, size, fill="white", font_weight="bold"))
    legend_x, legend_y = left + width + 6, top + 6
    for r in range(picture.ranks):
        y = legend_y + 13.5 * r
        out.append(f'<rect x="{legend_x:.1f}" y="{y:.1f}" width="16" height="5.6" '
                   f'fill="{rank_color(r)}"/>')
        out.append(_svg_text(legend_x + 22.4, y + 2.8, f"rank {r}", 8, "start"))
    out.append(_svg_text(left + width / 2, top - 16.5, f"{picture.title}\n{picture.subtitle}", 11,
                         fill=picture.title_color))
    out.append("</svg>")
    return "".join(out)


def heads_picture(cfg: Config, query_ranks: Sequence[int] | None = None) -> HeadsPicture:
    """``heads_layout``, or ``replica_groups_layout`` for fewer KV heads than ranks."""
    if cfg.kv_heads < cfg.world_size and query_ranks is None:
        return replica_groups_layout(cfg)
    return heads_layout(cfg, query_ranks)


def heads_layout(cfg: Config, query_ranks: Sequence[int] | None = None) -> HeadsPicture:
    """Query heads over KV heads in their ranks' colors, a line from each to the KV head it
    reads (dashed red across ranks); ``query_ranks``: a rank per query head."""
    if query_ranks is not None and (len(query_ranks) != cfg.query_heads or any(
            not 0 <= int(r) < cfg.world_size for r in query_ranks)):
        raise ValueError(f"query_ranks must give a rank in [0, {cfg.world_size}) for each of "
                         f"the {cfg.query_heads} query heads (got {list(query_ranks)!r})")
    hq, hkv, world = cfg.query_heads, cfg.kv_heads, cfg.world_size
    if query_ranks is None:
        query_ranks = [h // cfg.local_query_heads for h in range(hq)]
    kv_ranks = [j // cfg.local_kv_heads for j in range(hkv)]
    fontsize = 9 if hq <= 16 else 7 if hq <= 32 else 5
    box_w, box_h, q_y, kv_y = 0.8, 0.5, 1.6, 0.0
    kv_x = [cfg.group_size * j + (cfg.group_size - 1) / 2 for j in range(hkv)]
    lines, split = [], 0
    for h in range(hq):
        j = h // cfg.group_size
        crosses = int(query_ranks[h]) != kv_ranks[j]
        split += crosses
        lines.append((float(h), q_y - box_h / 2, kv_x[j], kv_y + box_h / 2,
                      FAIL_COLOR if crosses else "#888888", crosses, 1.6 if crosses else 1.0))
    boxes = [(float(h), q_y, box_w, box_h, rank_color(int(r)), f"q{h}", fontsize)
             for h, r in enumerate(query_ranks)]
    boxes += [(x, kv_y, box_w, box_h, rank_color(r), f"kv{j}", fontsize)
              for j, (x, r) in enumerate(zip(kv_x, kv_ranks))]
    verdict = (f"{split} query head(s) on another rank than their KV head" if split
               else "every rank holds complete query/KV groups")
    return HeadsPicture((min(12.0, max(6.0, 0.55 * hq + 2.5)), 2.9), (-2.2, hq - 0.3),
                        (-0.55, 2.1), (("query\nheads", q_y), ("KV\nheads", kv_y)),
                        f"{hq} query heads, {hkv} KV heads, {world} ranks", verdict,
                        FAIL_COLOR if split else "black", tuple(lines), tuple(boxes), (), world)


def replica_groups_layout(cfg: Config) -> HeadsPicture:
    """Query heads over one box per rank for the KV head it reads, framed by replica group."""
    hq, w, d = cfg.query_heads, cfg.world_size, cfg.head_dim
    per_rank = hq // w
    fontsize = 9 if hq <= 16 else 7 if hq <= 32 else 5
    q_y, kv_y, box_h = 1.7, 0.0, 0.5
    rank_x = [r * per_rank + (per_rank - 1) / 2 for r in range(w)]
    gather = has_replicas(cfg) and cfg.kv_strategy == GATHER_ACTIVATIONS
    lines = [(float(h), q_y - box_h / 2, rank_x[h // per_rank], kv_y + box_h / 2, "#888888",
              False, 1.0) for h in range(hq)]
    boxes = [(float(h), q_y, 0.8, box_h, rank_color(h // per_rank), f"q{h}", fontsize)
             for h in range(hq)]
    box_w = max(0.8, per_rank - 0.2)
    for r in range(w):
        first = kv_head_of_rank(cfg, r)
        if gather:
            rows = kv_weight_rows(cfg, r)
            label = f"rows {rows.start}–{rows.stop - 1}\n→ kv{first}"
        elif cfg.local_kv_heads == 1:
            label = f"kv{first}" + (" copy" if has_replicas(cfg) else "")
        else:
            label = f"kv{first}–{first + cfg.local_kv_heads - 1}"
        boxes.append((rank_x[r], kv_y, box_w, box_h, rank_color(r), label, fontsize - 1))
    groups = []
    for g, group in enumerate(replica_groups(cfg)):
        if len(group) < 2:
            continue
        left = rank_x[group[0]] - box_w / 2 - 0.15
        right = rank_x[group[-1]] + box_w / 2 + 0.15
        groups.append((left, kv_y - box_h / 2 - 0.18, right - left, box_h + 0.36,
                       f"replica group of kv{g}: ranks {group[0]}–{group[-1]}"))
    if not has_replicas(cfg):
        how = "every rank holds whole KV heads: no replicas"
    elif gather:
        how = "no copies: each rank projects a slice of K/V, all-gathers, keeps its head"
    else:
        how = (f"each KV head copied on {cfg.kv_replicas} ranks: "
               f"wk/wv grads all-reduced within each group")
    return HeadsPicture((min(12.0, max(6.0, 0.55 * hq + 3.0)), 3.2), (-2.4, hq - 0.3),
                        (-0.95, 2.2), (("query\nheads", q_y), ("K/V\nper rank", kv_y)),
                        f"{hq} query heads, {cfg.kv_heads} KV heads, {w} ranks ({d}-dim heads)",
                        how, "black", tuple(lines), tuple(boxes), tuple(groups), min(w, 8))
