"""Figures of chapter 13, fewer KV heads than ranks."""
from __future__ import annotations

from typing import Mapping, Sequence

from tpattn.config import Config
from tpattn.parallel.kv_heads import KV_STRATEGIES, has_replicas, kv_costs
from .heads import draw_heads, replica_groups_layout
from .sharding import drift_figure
from .style import FAIL_COLOR, new_figure

__all__ = ["replica_groups_figure", "kv_drift_figure", "kv_costs_figure"]


def replica_groups_figure(cfg: Config):
    """``draw_heads(replica_groups_layout(cfg))``."""
    return draw_heads(replica_groups_layout(cfg))


def kv_drift_figure(bug: Sequence[Mapping], ok: Sequence[Mapping]):
    """``drift_figure`` of ``train_steps`` rows: ``bug`` against dense; its losses and ``ok``'s."""
    labels = {"forward_max_abs_diff": "forward", "loss_abs_diff": "loss",
              "input_grad_max_abs_diff": "dX", "parameter_grad_max_abs_diff": "param grads",
              "kv_replica_max_diff": "KV copies apart"}
    diffs = {label: [row[key] for row in bug] for key, label in labels.items()}
    losses = {"dense": [row["dense_loss"] for row in ok],
              "TP, replica reduce missing": [row["tp_loss"] for row in bug]}
    return drift_figure(diffs, losses, title="missing KV grad reduce vs dense, each step")


def kv_costs_figure(cfg: Config):
    """``kv_costs(cfg)`` of both strategies: bytes a rank holds, and sends per step."""
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
