"""Which rows of a fused QKV checkpoint every rank holds under each loader ("Around the block")."""
from __future__ import annotations

import matplotlib.patches as mpatches
import torch

from tpattn.config import Config
from tpattn.check.core import shard
from tpattn.parallel.injection import Injection
from .style import FAIL_COLOR, new_figure

__all__ = ["LOADERS_SHOWN", "SHARD_LAYOUTS", "KIND_COLORS", "loaded_heads", "loaded_rows_figure"]

#: The loaders the figure shows by default: ``Injection.shard`` value -> title.
LOADERS_SHOWN = {
    "grouped": "grouped checkpoint, split per group (correct)",
    "grouped_as_plain": "grouped checkpoint read as [Q; K; V]",
    "fused": "plain [Wq; Wk; Wv], each rank its heads (correct)",
    "fused_rank0": "plain [Wq; Wk; Wv], loader called without tp_rank",
}
#: The ``Injection.shard`` values ``loaded_heads`` accepts.
SHARD_LAYOUTS = ("heads", "fused", "fused_naive", "fused_rank0", "grouped", "grouped_as_plain")
KIND_COLORS = {"q": "#9ecae1", "k": "#fdae6b", "v": "#a1d99b"}
_KINDS = ("q", "k", "v")


def loaded_heads(cfg: Config, layout: str) -> list[list[tuple[str, str, bool]]]:
    """Per rank, ``(slot, source, right)`` for its q, then k, then v heads when
    ``Injection(shard=layout)`` loads a checkpoint whose rows hold their head's code: ``"k"``
    used as ``"q3"``'s rows, and whether those are the rank's own."""
    if layout not in SHARD_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(SHARD_LAYOUTS)} (got {layout!r})")
    if cfg.kv_heads < cfg.world_size:
        raise ValueError(f"kv_heads must be >= world_size: every rank its own KV heads (got "
                         f"kv_heads={cfg.kv_heads}, world_size={cfg.world_size})")
    d = cfg.head_dim
    def coded(kind: int, heads: int) -> torch.Tensor:
        codes = torch.arange(heads, dtype=torch.float32) + 1000 * kind
        return codes.repeat_interleave(d)[:, None].expand(heads * d, cfg.hidden).clone()
    p = {"norm": torch.ones(cfg.hidden), "wq": coded(0, cfg.query_heads),
         "wk": coded(1, cfg.kv_heads), "wv": coded(2, cfg.kv_heads),
         "wo": torch.zeros(cfg.hidden, cfg.query_heads * d)}
    right = shard(p, cfg, Injection())
    out = []
    for r, mine in enumerate(shard(p, cfg, Injection(shard=layout))):
        heads = []
        for kind, name in zip(_KINDS, ("wq", "wk", "wv")):
            got, want = mine[name][::d, 0], right[r][name][::d, 0]
            for code, own in zip(got.tolist(), want.tolist()):
                source = f"{_KINDS[int(code) // 1000]}{int(code) % 1000}"
                heads.append((kind, source, code == own))
        out.append(heads)
    return out


def loaded_rows_figure(cfg: Config, layouts=tuple(LOADERS_SHOWN)):
    """A panel per loader: every rank's ``loaded_heads`` as boxes (red frame: not its own)."""
    fig, axes = new_figure(1, len(layouts), figsize=(6.3, 0.55 + 0.42 * cfg.world_size
                                                      * len(layouts)), squeeze=False)
    slots = (cfg.query_heads + 2 * cfg.kv_heads) // cfg.world_size
    size = 8 if slots <= 12 else 6
    for ax, layout in zip(axes[:, 0], layouts):
        for r, heads in enumerate(loaded_heads(cfg, layout)):
            y = cfg.world_size - 1 - r
            for i, (slot, source, right) in enumerate(heads):
                ax.add_patch(mpatches.Rectangle(
                    (i + 0.06, y + 0.1), 0.88, 0.8, facecolor=KIND_COLORS[source[0]],
                    edgecolor="#444444" if right else FAIL_COLOR, linewidth=0.8 if right else 2))
                ax.text(i + 0.5, y + 0.5, source, ha="center", va="center", fontsize=size)
        ax.set(xlim=(0, slots), ylim=(0, cfg.world_size))
        ax.set_yticks([cfg.world_size - 0.5 - r for r in range(cfg.world_size)],
                      [f"rank {r}" for r in range(cfg.world_size)])
        q, kv = cfg.local_query_heads, cfg.local_kv_heads
        ax.set_xticks([q / 2, q + kv / 2, q + kv * 1.5], ["used as q", "as k", "as v"])
        ax.tick_params(length=0)
        for x in (q, q + kv):
            ax.axvline(x, color="#444444", linewidth=1)
        ax.set_title(LOADERS_SHOWN.get(layout, layout), fontsize=9, loc="left")
        ax.spines[["left", "bottom"]].set_visible(False)
    fig.suptitle(f"what each rank loads: Hq={cfg.query_heads}, Hkv={cfg.kv_heads}, "
                 f"W={cfg.world_size} (red: not its own rows)", fontsize=10)
    return fig
