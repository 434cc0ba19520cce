"""Figures of chapter 13, fewer KV heads than ranks: replica groups, the drift of the missing
replica-group reduce, and what each ``kv_strategy`` costs."""
from __future__ import annotations

from typing import Mapping, Sequence

from tpattn.config import Config
from tpattn.parallel.kv_heads import (GATHER_ACTIVATIONS, KV_STRATEGIES, has_replicas, kv_costs,
                        kv_head_of_rank, kv_weight_rows, replica_groups)
from .frames import HeadsPicture, draw_heads
from .sharding import drift_figure
from .style import FAIL_COLOR, new_figure, rank_color

__all__ = ["replica_groups_figure", "replica_groups_layout", "kv_drift_figure",
           "kv_costs_figure"]


def replica_groups_figure(cfg: Config):
    """Query heads (top) in their rank's color; one box per rank (bottom) for the KV head it
    reads (``replicate_weights``: a copy of its wk/wv rows; ``gather_activations``: the rank's
    slice of them), framed by replica group. Draws ``replica_groups_layout(cfg)``."""
    return draw_heads(replica_groups_layout(cfg))


def replica_groups_layout(cfg: Config) -> HeadsPicture:
    """What ``replica_groups_figure(cfg)`` draws: boxes, lines, replica groups, legend, title."""
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

def kv_drift_figure(bug: Sequence[Mapping], ok: Sequence[Mapping]):
    """``train_steps`` rows of the missing replica-group reduce (``bug``) and the correct run
    (``ok``): left, per step, the bug's differences from dense; right, the losses."""
    labels = {"forward_max_abs_diff": "forward", "loss_abs_diff": "loss",
              "input_grad_max_abs_diff": "dX", "parameter_grad_max_abs_diff": "param grads",
              "kv_replica_max_diff": "KV copies apart"}
    diffs = {label: [row[key] for row in bug] for key, label in labels.items()}
    losses = {"dense": [row["dense_loss"] for row in ok],
              "TP, replica reduce missing": [row["tp_loss"] for row in bug]}
    return drift_figure(diffs, losses, title="missing KV grad reduce vs dense, each step")


def kv_costs_figure(cfg: Config):
    """Both strategies for ``cfg`` (``kv_costs``): KV bytes one rank holds (left) and sends per
    step (right, with f/g)."""
    costs = kv_costs(cfg)
    size = costs[next(iter(costs))]["weight_bytes"] // costs[next(iter(costs))]["weight_elements"]
    names = [s for s in KV_STRATEGIES if s in costs]
    fig, (left, right) = new_figure(ncols=2, figsize=(7.5, 2.8))
    x = range(len(names))
    held = {"wk/wv weights": [costs[s]["kv_weight_elements"] * size for s in names],
            "K/V activations": [costs[s]["kv_activation_elements"] * size for s in names]}
    moved = {"KV collectives": [costs[s]["kv_bytes_moved"] for s in names],
             "f and g": [costs[s]["fg_bytes_moved"] for s in names]}
    for ax, series, title in ((left, held, "KV bytes held per rank"),
                              (right, moved, "bytes sent per rank per step")):
        bottom = [0] * len(names)
        for (label, values), color in zip(series.items(), ("#1f77b4", "#ff7f0e")):
            ax.bar(list(x), values, bottom=bottom, color=color, label=label, width=0.6)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(list(x), [n.replace("_", " ") for n in names], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    if not has_replicas(cfg):
        left.set_title("no replicas: nothing to compare", color=FAIL_COLOR, fontsize=10)
    return fig
