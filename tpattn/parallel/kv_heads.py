"""Fewer KV heads than ranks: replica groups, their gradient reduce, and the all-gather option.

With ``kv_heads < world_size``, rank r's query heads read KV head ``r // (W/Hkv)``, shared by
its replica group (``SimulatedRanks.groups("kv_replicas")``). ``Config.kv_strategy``:
``replicate_weights`` (each rank a copy of the head's wk/wv rows; backward all-reduce of their
gradients in the group, ``ReduceReplicaGrads``) or ``gather_activations`` (no copies: each
rank's slice of K/V all-gathered, ``GatherKV``; Megatron-LM PR 2565). This module: one rank's
pieces of the gather option, the KV collectives' ledger labels, and the memory and bytes
of each strategy (``kv_costs``, ``kv_collectives``, ``ring_bytes``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpattn.config import KV_STRATEGIES, Config
from tpattn.block.layers import apply_rope, attention, repeat_kv

from tpattn.block.kv_layout import (GATHER_ACTIVATIONS, REPLICATE_WEIGHTS, has_replicas,
                                    is_first_kv_copy, kv_grad_bug_applies, kv_head_of_rank,
                                    kv_weight_rows, replica_groups, replica_index)

__all__ = [
    "REPLICATE_WEIGHTS", "GATHER_ACTIVATIONS", "KV_STRATEGIES",
    "has_replicas", "kv_head_of_rank", "replica_groups", "replica_index", "kv_weight_rows",
    "is_first_kv_copy",
    "kv_grad_bug_applies", "local_kv", "attend_gathered",
    "kv_collectives", "kv_costs", "ring_bytes",
    "unique_parameters", "global_grad_norm", "fused_qkv_gather_bytes",
]


# --- gather_activations: the per-rank pieces --------------------------------------------------

def local_kv(n: torch.Tensor, shard: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's slice of the K and V projections, side by side (what it all-gathers).

    n: ``[S, B, hidden]``; ``shard["wk"], shard["wv"]``: ``[c, hidden]``. Returns
    ``[S, B, 2c]`` (K slice, then V slice).
    """
    return torch.cat([F.linear(n, shard["wk"]), F.linear(n, shard["wv"])], dim=-1)


def attend_gathered(n: torch.Tensor, shard: dict[str, torch.Tensor], kv_all: torch.Tensor,
                    cfg: Config, rank: int) -> torch.Tensor:
    """One rank's partial output from the gathered K/V: slice KV head ``kv_head_of_rank``,
    RoPE, attention of its query heads, its columns of wo.

    n: ``[S, B, hidden]``; kv_all: ``[S, B, W*2c]`` — every rank's ``local_kv`` in rank order.
    Returns ``[S, B, hidden]`` (this rank's partial sum).
    """
    s, b, d, w = n.shape[0], n.shape[1], cfg.head_dim, cfg.world_size
    parts = kv_all.view(s, b, w, 2, -1)  # rank, (K | V), slice
    k_all = parts[:, :, :, 0].reshape(s, b, cfg.kv_heads, d)
    v_all = parts[:, :, :, 1].reshape(s, b, cfg.kv_heads, d)
    h = kv_head_of_rank(cfg, rank)
    q = apply_rope(F.linear(n, shard["wq"]).view(s, b, -1, d))
    k, v = apply_rope(k_all[:, :, h:h + 1]), v_all[:, :, h:h + 1]
    ctx = attention(q, repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2]))
    return F.linear(ctx.reshape(s, b, -1), shard["wo"])


#: Labels of the KV collectives (they name the collective in errors and in the ledger).
KV_GRAD_ALL_REDUCE = "all-reduce of wk/wv grads in the replica group"
KV_ALL_GATHER = "all-gather of K/V activations"
KV_REDUCE_SCATTER = "reduce-scatter of K/V activation grads"


# --- what each strategy costs --------------------------------------------------------------

def ring_bytes(kind: str, elements: int, group_size: int, element_size: int) -> int:
    """Bytes one rank sends in a ring collective (the bandwidth-optimal algorithm's count):
    all-reduce of N elements ``2(p-1)/p * N``; all-gather (N = output) and reduce-scatter
    (N = input) ``(p-1)/p * N``. ``group_size`` p divides N here, so the result is exact."""
    p = group_size
    factors = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    if kind not in factors:
        raise ValueError(f"kind must be one of {', '.join(factors)} (got {kind!r})")
    factor = factors[kind]
    return factor * (p - 1) * elements // p * element_size


def kv_collectives(cfg: Config) -> list[dict]:
    """The KV collectives one rank issues in one correct step of ``cfg``, in order: ``label``,
    ``phase``, ``kind``, ``group_size`` and ``elements`` (of the buffer passed to the collective:
    the all-reduce's tensor, the all-gather's output, the reduce-scatter's input).

    Empty when ``kv_heads >= world_size``. ``tpattn.real.ranks``'s ledger records the same rows
    on real ranks (``RealRankReport.traffic``), which tests compare.
    """
    if not has_replicas(cfg):
        return []
    if cfg.kv_strategy == GATHER_ACTIVATIONS:
        kv = 2 * cfg.seq * cfg.batch * cfg.kv_heads * cfg.head_dim  # K and V, all heads
        w = cfg.world_size
        return [{"label": KV_ALL_GATHER, "phase": "forward", "kind": "all_gather",
                 "group_size": w, "elements": kv},
                {"label": KV_REDUCE_SCATTER, "phase": "backward", "kind": "reduce_scatter",
                 "group_size": w, "elements": kv}]
    return [{"label": KV_GRAD_ALL_REDUCE, "phase": "backward", "kind": "all_reduce",
             "group_size": cfg.kv_replicas, "elements": 2 * cfg.head_dim * cfg.hidden}]


def kv_costs(cfg: Config) -> dict:
    """Memory per rank and bytes moved per step of one block, for ``cfg``'s shape under BOTH
    strategies (``cfg.kv_strategy`` itself is ignored). Element size from ``cfg.dtype``.

    Returns ``{strategy: {...}}`` (a strategy the shape does not allow is left out) with,
    per rank:

    - ``weight_elements`` / ``weight_bytes``: norm, wq, wk, wv and wo shards held;
    - ``kv_weight_elements``: the wk + wv part of it;
    - ``kv_activation_elements``: K and V activations it holds for attention (its own head
      after the gather holds ALL heads' K/V, the gathered buffer);
    - ``kv_bytes_moved``: bytes it sends in the KV collectives (``ring_bytes`` of
      ``kv_collectives``); ``fg_bytes_moved``: the same for f and g, equal in both strategies.
    """
    from dataclasses import replace

    size = torch.empty((), dtype=cfg.torch_dtype).element_size()
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
        if has_replicas(cfg) and strategy == GATHER_ACTIVATIONS:
            activations = 2 * tokens * cfg.kv_heads * d
        else:
            activations = 2 * tokens * cfg.local_kv_heads * d
        moved = sum(ring_bytes(r["kind"], r["elements"], r["group_size"], size)
                    for r in kv_collectives(c))
        out[strategy] = {"weight_elements": weights, "weight_bytes": weights * size,
                         "kv_weight_elements": kv_rows * h,
                         "kv_activation_elements": activations,
                         "kv_bytes_moved": moved, "fg_bytes_moved": fg}
    return out


def fused_qkv_gather_bytes(cfg: Config) -> int:
    """Bytes one rank sends per step when the whole fused Q/K/V activation (``mixed_qkv``,
    ``tokens x (Hq + 2 Hkv) x D`` values) is all-gathered in the forward and reduce-scattered in
    the backward over the ``world_size`` ranks, and each rank then slices its heads out — what
    Megatron-Core does when ``num_query_groups < tensor_model_parallel_size``
    (NVIDIA/Megatron-LM#2565). Ring counts (``ring_bytes``), element size from ``cfg.dtype``."""
    size = torch.empty((), dtype=cfg.torch_dtype).element_size()
    elements = cfg.seq * cfg.batch * (cfg.query_heads + 2 * cfg.kv_heads) * cfg.head_dim
    w = cfg.world_size
    return ring_bytes("all_gather", elements, w, size) + ring_bytes("reduce_scatter", elements, w, size)


# --- replicas counted once: gradient norm, clipping, checkpoints ------------------------------

def unique_parameters(cfg: Config, rank_tensors: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every distinct parameter tensor of a TP block once, from each rank's ``norm``, ``wq``,
    ``wk``, ``wv``, ``wo`` (weights or their gradients; one dict per rank).

    ``norm`` is replicated on every rank: rank 0's is kept. ``wq``/``wo`` shards are disjoint:
    all kept (``"wq@r"``, ``"wo@r"``). ``wk``/``wv`` are kept only from a rank that holds the
    first copy of its rows (``is_first_kv_copy``): under ``replicate_weights`` the other ranks of
    a replica group hold the same head again. This is what a gradient norm (for clipping) must
    sum over and what a checkpoint must store once.
    """
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
    """The L2 norm of the whole block's gradient from every rank's gradients, each replicated
    tensor counted once (``unique_parameters``), accumulated in float64 — equal to the dense
    block's gradient norm when the replicas' gradients have been all-reduced."""
    unique = unique_parameters(cfg, rank_grads)
    return float(sum(g.double().square().sum() for g in unique.values()) ** 0.5)


# --- several steps: how the missing reduce drifts -------------------------------------------
