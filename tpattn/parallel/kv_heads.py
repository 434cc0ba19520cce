"""Fewer KV heads than ranks (rank r reads KV head ``r // (W/Hkv)``): what ``replicate_weights``
and ``gather_activations`` (Megatron-LM PR 2565) cost, and each replica counted once."""
from __future__ import annotations

from dataclasses import replace

import torch

from tpattn.config import KV_STRATEGIES, Config
from .collectives import KV_GATHER_LABEL, KV_SCATTER_LABEL, REPLICA_GRAD_LABEL
from tpattn.block.kv_layout import (GATHER_ACTIVATIONS, REPLICATE_WEIGHTS, has_replicas,
                                    is_first_kv_copy, kv_grad_bug_applies, kv_head_of_rank,
                                    kv_weight_rows, replica_groups, replica_index)

__all__ = ["REPLICATE_WEIGHTS", "GATHER_ACTIVATIONS", "KV_STRATEGIES", "has_replicas",
           "kv_head_of_rank", "replica_groups", "replica_index", "kv_weight_rows",
           "is_first_kv_copy", "kv_grad_bug_applies", "kv_collectives", "kv_costs", "ring_bytes",
           "unique_parameters", "global_grad_norm", "fused_qkv_gather_bytes"]


def ring_bytes(kind: str, elements: int, group_size: int, element_size: int) -> int:
    """Bytes one rank sends in a ring collective over ``group_size`` p: all-reduce of N
    elements ``2(p-1)/p * N``, all-gather (N: output) and reduce-scatter (N: input) ``(p-1)/p * N``."""
    factors = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    if kind not in factors:
        raise ValueError(f"kind must be one of {', '.join(factors)} (got {kind!r})")
    return factors[kind] * (group_size - 1) * elements // group_size * element_size


def kv_collectives(cfg: Config) -> list[dict]:
    """The KV collectives of one rank in one correct step, as ``ring_bytes`` reads them."""
    if not has_replicas(cfg):
        return []
    if cfg.kv_strategy == GATHER_ACTIVATIONS:
        kv = 2 * cfg.seq * cfg.batch * cfg.kv_heads * cfg.head_dim  # K and V, all heads
        w = cfg.world_size
        return [{"label": KV_GATHER_LABEL, "phase": "forward", "kind": "all_gather",
                 "group_size": w, "elements": kv},
                {"label": KV_SCATTER_LABEL, "phase": "backward", "kind": "reduce_scatter",
                 "group_size": w, "elements": kv}]
    return [{"label": REPLICA_GRAD_LABEL, "phase": "backward", "kind": "all_reduce",
             "group_size": cfg.kv_replicas, "elements": 2 * cfg.head_dim * cfg.hidden}]


def kv_costs(cfg: Config) -> dict:
    """Per rank and step, for each strategy the shape allows: ``weight_elements``/``_bytes``,
    ``kv_weight_elements``, ``kv_activation_elements``, ``kv_bytes_moved``, ``fg_bytes_moved``."""
    size = cfg.torch_dtype.itemsize
    d, h, w, tokens = cfg.head_dim, cfg.hidden, cfg.world_size, cfg.seq * cfg.batch
    fg = 2 * ring_bytes("all_reduce", tokens * h, w, size) if w > 1 else 0
    out = {}
    for strategy in KV_STRATEGIES:
        try:
            c = replace(cfg, kv_strategy=strategy) if has_replicas(cfg) else cfg
        except ValueError:  # gather_activations needs kv_heads*head_dim % world_size == 0
            continue
        kv_rows = 2 * (kv_weight_rows(c, 0).stop - kv_weight_rows(c, 0).start)
        weights = h + 2 * cfg.local_query_heads * d * h + kv_rows * h
        gathered = has_replicas(cfg) and strategy == GATHER_ACTIVATIONS
        activations = 2 * tokens * (cfg.kv_heads if gathered else cfg.local_kv_heads) * d
        moved = sum(ring_bytes(r["kind"], r["elements"], r["group_size"], size)
                    for r in kv_collectives(c))
        out[strategy] = {"weight_elements": weights, "weight_bytes": weights * size,
                         "kv_weight_elements": kv_rows * h,
                         "kv_activation_elements": activations,
                         "kv_bytes_moved": moved, "fg_bytes_moved": fg}
    return out


def fused_qkv_gather_bytes(cfg: Config) -> int:
    """Bytes one rank sends per step all-gathering the fused Q/K/V activation (Megatron-LM#2565)."""
    elements = cfg.seq * cfg.batch * (cfg.query_heads + 2 * cfg.kv_heads) * cfg.head_dim
    return sum(ring_bytes(kind, elements, cfg.world_size, cfg.torch_dtype.itemsize)
               for kind in ("all_gather", "reduce_scatter"))


def unique_parameters(cfg: Config, rank_tensors: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every distinct tensor of the block once, from one dict per rank: rank 0's ``norm``,
    every ``"wq@r"``/``"wo@r"``, ``"wk@r"``/``"wv@r"`` of each KV head's first copy."""
    if len(rank_tensors) != cfg.world_size:
        raise ValueError(f"rank_tensors must hold one dict per rank, world_size={cfg.world_size} "
                         f"(got {len(rank_tensors)})")
    out = {"norm": rank_tensors[0]["norm"]}
    for rank, t in enumerate(rank_tensors):
        out[f"wq@{rank}"], out[f"wo@{rank}"] = t["wq"], t["wo"]
        if is_first_kv_copy(cfg, rank):
            out[f"wk@{rank}"], out[f"wv@{rank}"] = t["wk"], t["wv"]
    return out


def global_grad_norm(cfg: Config, rank_grads: list[dict[str, torch.Tensor]]) -> float:
    """The block's gradient norm, each replica once (``unique_parameters``), in float64."""
    unique = unique_parameters(cfg, rank_grads)
    return float(sum(g.double().square().sum() for g in unique.values()) ** 0.5)

