"""Figure of chapter 19, the whole model: one rank's layout of the decoder LM under TP."""
from __future__ import annotations

import matplotlib.patches as mpatches

from tpattn.model.config import LMConfig
from .style import DENSE_COLOR, arrow, bare_axes, box, new_figure

__all__ = ["LM_LAYOUT_REGIONS", "lm_layout_steps", "lm_layout_figure"]

_COLLECTIVE = "#6a3d9a"  # f, g and the loss's all-reduces
#: The figure's shaded kinds of region: face color and legend text.
LM_LAYOUT_REGIONS = {
    "vocab": ("#e3f2e1", "vocabulary-parallel: V/W rows of the vocabulary per rank"),
    "sharded": ("#fdf0e2", "sharded: H/W heads or ffn/W features per rank"),
    "replicated": ("#ffffff", "replicated: the same on every rank"),
}
_ROW1, _ROW2 = 2.6, 0.0  # the two rows' heights
_RADIUS, _GAP, _HEIGHT = 0.24, 0.26, 0.95


def lm_layout_steps(lm: LMConfig) -> tuple[list, list]:
    """The figure's two rows, left to right: ``("box", width, text)`` or ``("op", letter,
    what its passes do)`` per step of one rank of ``lm``."""
    v, w, ffn = lm.vocab // lm.block.world_size, lm.block.world_size, lm.ffn
    head = "embed's slice\n(tied)" if lm.tied else "head's slice"
    first = [("box", 0.7, "tokens\n[S, B]"),
             ("box", 1.15, f"own rows of\nembed slice\n[{v}, H];\nothers: 0"),
             ("op", "g", "fwd: Σ ranks"), ("box", 0.55, "norm"), ("op", "f", "bwd: Σ dn"),
             ("box", 1.0, "Q, K, V:\nH/W heads;\nwo columns"), ("op", "g", "fwd: Σ ranks"),
             ("box", 0.55, "norm"), ("op", "f", "bwd: Σ dn"),
             ("box", 1.15, f"gate, up rows,\ndown columns:\n{ffn // w} of {ffn}\nfeatures"),
             ("op", "g", "fwd: Σ ranks")]
    second = [("box", 0.65, "final\nnorm"), ("op", "f", "bwd: Σ dn"),
              ("box", 1.2, f"{head}\n[{v}, H]\n→ logits\n[S, B, {v}]"),
              ("box", 1.0, "local max,\nΣ exp and\ntarget logit"),
              ("op", "max", "all-reduce\nMAX"), ("op", "Σexp", "all-reduce\nSUM"),
              ("op", "z_t", "all-reduce\nSUM (only\nthe owner's)"),
              ("box", 1.3, "loss =\nlog Σexp − z_t,\nthe same on\nevery rank")]
    return first, second


def _draw_row(ax, steps: list, y: float, left: float = 0.0) -> list[float]:
    """``steps`` drawn on row ``y`` from ``left``, arrows between them; their centers."""
    centers, x = [], left
    for kind, size, text in steps:
        width = 2 * _RADIUS if kind == "op" else size
        centers.append(x + width / 2)
        if kind == "box":
            box(ax, x + width / 2, y, width, _HEIGHT, text, size=7)
        else:
            ax.add_patch(mpatches.Circle((x + _RADIUS, y), _RADIUS, facecolor="white",
                                         edgecolor=_COLLECTIVE, lw=1.5, zorder=3))
            ax.text(x + _RADIUS, y, size, ha="center", va="center", weight="bold", zorder=4,
                    fontsize=11 if len(size) == 1 else 7, color=_COLLECTIVE)
            ax.text(x + _RADIUS, y - 0.3, text, ha="center", va="top", fontsize=6.5,
                    color=_COLLECTIVE)
        if x > left:
            arrow(ax, (x - _GAP + 0.02, y), (x - 0.02, y))
        x += width + _GAP
    return centers


def _region(ax, left: float, right: float, y: float, kind: str, label: str = "") -> None:
    """A shaded band of ``kind`` from x ``left`` to ``right`` around row ``y``, ``label`` on it."""
    ax.add_patch(mpatches.FancyBboxPatch((left, y - 0.62), right - left, 1.24,
                                         boxstyle="round,pad=0.0,rounding_size=0.08",
                                         facecolor=LM_LAYOUT_REGIONS[kind][0],
                                         edgecolor="#bbbbbb", lw=0.8, zorder=0))
    if label:
        ax.text((left + right) / 2, y + 0.66, label, ha="center", va="bottom", fontsize=7.5,
                style="italic")


def _frames(ax, lm: LMConfig, top: list[float], bottom: list[float]) -> None:
    """The regions of both rows, the dashed frame of one layer, the turn from row 1 to 2."""
    _region(ax, top[0] + 0.3, top[2], _ROW1, "vocab", "embedding")
    _region(ax, top[4], top[6], _ROW1, "sharded", "attention (chapters 6–7)")
    _region(ax, top[8], top[10], _ROW1, "sharded", "SwiGLU MLP (chapter 7)")
    _region(ax, bottom[1], bottom[6], _ROW2, "vocab",
            "LM head and cross-entropy: vocabulary-parallel")
    left, right = top[3] - 0.4, top[10] + 0.4
    ax.add_patch(mpatches.FancyBboxPatch((left, _ROW1 - 1.05), right - left, 2.3,
                                         boxstyle="round,pad=0.0,rounding_size=0.1",
                                         facecolor="none", edgecolor=DENSE_COLOR, lw=1, ls="--"))
    ax.text(left + 0.08, _ROW1 + 1.18, f"× {lm.layers} layers, each sublayer x + g(…): the "
            f"residual x stays replicated", ha="left", va="top", fontsize=7.5)
    turn = _ROW1 - 1.25
    ax.plot([top[10], top[10], bottom[0]], [_ROW1 - 0.72, turn, turn], color=DENSE_COLOR,
            lw=1.1)
    arrow(ax, (bottom[0], turn), (bottom[0], _ROW2 + _HEIGHT / 2 + 0.03))


def lm_layout_figure(lm: LMConfig | None = None):
    """One rank of the decoder LM under TP, left to right: its vocabulary slice of the
    embedding (masked lookup, then g), every layer's attention and SwiGLU MLP each between f
    and g, the final norm, f, its slice of the LM head, and the cross-entropy with its three
    all-reduced statistics; shaded by how each part is split (``lm``: the shapes written)."""
    lm = LMConfig() if lm is None else lm
    fig, ax = new_figure(figsize=(10.0, 4.7))
    first, second = lm_layout_steps(lm)
    top = _draw_row(ax, first, _ROW1)
    bottom = _draw_row(ax, second, _ROW2, left=0.3)
    _frames(ax, lm, top, bottom)
    handles = [mpatches.Patch(facecolor=face, edgecolor="#bbbbbb", label=text)
               for face, text in LM_LAYOUT_REGIONS.values()]
    handles.append(mpatches.Patch(facecolor="white", edgecolor=_COLLECTIVE,
                                  label="collective: f, g (chapter 7), the loss's all-reduces"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.04), ncols=2,
              fontsize=7.5, frameon=False)
    ax.set_title(f"One rank of {lm.block.world_size} in the whole LM: f and g around every "
                 f"sharded region, plus the vocabulary split", fontsize=10)
    bare_axes(ax, (-0.1, top[-1] + 0.55), (_ROW2 - 1.2, _ROW1 + 1.3), equal=True)
    return fig
