"""Figures of chapter 13, fewer KV heads than ranks."""
from __future__ import annotations

from typing import Mapping, Sequence

from tpattn.config import Config
from .heads import draw_heads, replica_groups_layout
from .sharding import drift_figure

__all__ = ["replica_groups_figure", "kv_drift_figure"]


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

