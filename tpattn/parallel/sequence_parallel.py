"""Sequence parallelism (SP): the TP block with the residual stream sharded along the sequence.

Korthikanti et al. 2022 (arXiv:2205.05198), Megatron-LM's ``--sequence-parallel``: each rank
holds its ``S/W`` tokens; f becomes an all-gather along the sequence (backward reduce-scatter),
g a reduce-scatter (backward all-gather), both ``collectives.GatherSequence`` /
``ScatterSequence`` in the engine's one block. RoPE needs global positions (``rank_tokens``);
the ``norm`` weight's gradient is a partial sum, all-reduced after backward. This module: the
token layout and what SP's collectives cost (``communication_ledger``,
``norm_activation_bytes``).
"""
from __future__ import annotations

import torch

from tpattn.config import Config
from tpattn.block.layers import rms_norm
from .kv_heads import ring_bytes
from .wrong import ScaleGrad

__all__ = ["NORM_GRAD_REDUCTIONS", "rank_tokens", "ScaleGrad", "ring_bytes",
           "communication_ledger", "norm_activation_bytes"]

#: How the ranks' ``norm`` gradients are combined after backward: ``"sum"`` (correct, an
#: all-reduce), ``"mean"`` (the ``norm_grad_averaged`` bug), ``"none"`` (dropped).
NORM_GRAD_REDUCTIONS = ("sum", "mean", "none")


def rank_tokens(cfg: Config, rank: int) -> slice:
    """The positions of the sequence rank ``rank`` holds under SP: ``[r*S/W, (r+1)*S/W)``."""
    local = cfg.seq // cfg.world_size
    return slice(rank * local, (rank + 1) * local)


# --- what the collectives cost ----------------------------------------------------------

def communication_ledger(cfg: Config) -> list[dict]:
    """The collectives one correct training step of the block issues, without and with SP.

    One row per collective: ``variant`` (``"TP"``/``"SP"``), ``collective``, ``phase``,
    ``elements`` of the whole tensor and ``bytes_per_rank`` sent (``ring_bytes``). TP: g's and
    f's all-reduces of ``[S, B, hidden]``. SP: two all-gathers and two reduce-scatters of the
    same size, plus the all-reduce of the ``norm`` gradient (``[hidden]``).
    """
    w, item = cfg.world_size, torch.empty((), dtype=cfg.torch_dtype).element_size()
    act, hid = cfg.seq * cfg.batch * cfg.hidden, cfg.hidden
    rows = [("TP", "all_reduce", "forward", act, "g: sum of output partials"),
            ("TP", "all_reduce", "backward", act, "f: sum of dn"),
            ("SP", "all_gather", "forward", act, "n along the sequence"),
            ("SP", "reduce_scatter", "forward", act, "output partials"),
            ("SP", "all_gather", "backward", act, "dy (reduce-scatter's backward)"),
            ("SP", "reduce_scatter", "backward", act, "dn (all-gather's backward)"),
            ("SP", "all_reduce", "after backward", hid, "norm weight's gradient")]
    return [{"variant": v, "collective": c, "phase": p, "what": what, "elements": n,
             "bytes_per_rank": float(ring_bytes(c, n, w, item))} for v, c, p, n, what in rows]


def norm_activation_bytes(cfg: Config) -> int:
    """Bytes one rank's RMSNorm saves for backward (its activations; the weight excluded),
    measured with ``torch.autograd.graph.saved_tensors_hooks`` on ``cfg.local_seq`` tokens."""
    x = torch.randn(cfg.local_seq, cfg.batch, cfg.hidden, dtype=cfg.torch_dtype, requires_grad=True)
    weight = torch.ones(cfg.hidden, dtype=cfg.torch_dtype, requires_grad=True)
    saved = []

    def pack(t):
        if t.data_ptr() != weight.data_ptr():
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rms_norm(x, weight, cfg.eps)
    return sum(saved)
