"""Heads pictures from a ``Config``: which rank holds which query and KV heads."""
from __future__ import annotations

from typing import Sequence

from tpattn.config import Config
from tpattn.parallel.kv_heads import (GATHER_ACTIVATIONS, has_replicas, kv_head_of_rank,
                                      kv_weight_rows, replica_groups)
from .frames import HeadsPicture
from .style import FAIL_COLOR, rank_color

__all__ = ["heads_picture", "heads_layout", "replica_groups_layout"]


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
