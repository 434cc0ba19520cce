"""Sequence parallelism (Korthikanti et al. 2022): each rank's tokens and what SP's collectives
cost. f becomes an all-gather along the sequence, g a reduce-scatter (``collectives``)."""
from __future__ import annotations

import torch

from tpattn.config import Config
from tpattn.block.layers import rms_norm
from .kv_heads import ring_bytes

__all__ = ["rank_tokens", "ring_bytes", "communication_ledger", "norm_activation_bytes"]


def rank_tokens(cfg: Config, rank: int) -> slice:
    """The positions of the sequence rank ``rank`` holds under SP: ``[r*S/W, (r+1)*S/W)``."""
    local = cfg.seq // cfg.world_size
    return slice(rank * local, (rank + 1) * local)


def communication_ledger(cfg: Config) -> list[dict]:
    """The collectives of one correct step without and with SP, one row each (``ring_bytes``)."""
    w, item = cfg.world_size, cfg.torch_dtype.itemsize
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
    """Bytes one rank's RMSNorm saves for backward on ``cfg.local_seq`` tokens (weight excluded)."""
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
