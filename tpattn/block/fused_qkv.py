"""Fused QKV checkpoints ``[(Hq + 2*Hkv)*D, hidden]`` in two row orders, and a rank's loader.

``plain`` is ``[Wq; Wk; Wv]`` (GLM's); ``grouped`` is, per KV group g, ``[q rows of g's query
heads; k_g; v_g]`` (Megatron-Core's ``linear_qkv``, Falcon-40B's)."""
from __future__ import annotations

import torch

from tpattn.config import Config
from .kv_layout import check_rank
from .params import dense_shapes

__all__ = ["FUSED_LAYOUTS", "fused_qkv_rows", "fuse_qkv_weight", "split_qkv_weight",
           "rank_row_block", "read_rank_qkv", "load_qkv_weight"]

#: The row orders of a fused QKV checkpoint.
FUSED_LAYOUTS = ("plain", "grouped")


def _check_layout(layout: str, name: str = "layout") -> None:
    if layout not in FUSED_LAYOUTS:
        raise ValueError(f"{name} must be one of {', '.join(FUSED_LAYOUTS)} (got {layout!r})")


def fused_qkv_rows(cfg: Config) -> int:
    """Rows of the fused weight: ``(Hq + 2*Hkv) * D``."""
    return (cfg.query_heads + 2 * cfg.kv_heads) * cfg.head_dim


def _check_fused(w: torch.Tensor, cfg: Config, name: str = "w") -> None:
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (fused_qkv_rows(cfg), cfg.hidden):
        got = list(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{name} must be [(query_heads + 2*kv_heads)*head_dim, hidden] = "
                         f"{[fused_qkv_rows(cfg), cfg.hidden]} (got {got})")


def fuse_qkv_weight(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, cfg: Config,
                    layout: str = "grouped") -> torch.Tensor:
    """``wq`` ``[Hq*D, hidden]``, ``wk``, ``wv`` ``[Hkv*D, hidden]`` fused in ``layout``."""
    _check_layout(layout)
    want = dense_shapes(cfg)
    for name, w in zip(("wq", "wk", "wv"), (wq, wk, wv)):
        if tuple(w.shape) != want[name]:
            raise ValueError(f"{name} must be {list(want[name])} for this Config "
                             f"(got {list(w.shape)})")
    if layout == "plain":
        return torch.cat([wq, wk, wv])
    d, h = cfg.head_dim, cfg.hidden
    groups = [wq.reshape(cfg.kv_heads, cfg.group_size * d, h), wk.reshape(cfg.kv_heads, d, h),
              wv.reshape(cfg.kv_heads, d, h)]
    return torch.cat(groups, dim=1).reshape(fused_qkv_rows(cfg), h)


def _split_groups(rows: torch.Tensor, groups: int, cfg: Config):
    """``[groups * (g+2) * D, hidden]`` read as ``groups`` x ``[q x g; k; v]``."""
    g, d, h = cfg.group_size, cfg.head_dim, cfg.hidden
    q, k, v = rows.reshape(groups, (g + 2) * d, h).split([g * d, d, d], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def split_qkv_weight(w: torch.Tensor, cfg: Config, layout: str = "grouped"):
    """``fuse_qkv_weight``'s inverse: ``(wq, wk, wv)`` from the fused ``w`` in ``layout``."""
    _check_layout(layout)
    _check_fused(w, cfg)
    if layout == "plain":
        return tuple(w.split([dense_shapes(cfg)[k][0] for k in ("wq", "wk", "wv")]))
    return _split_groups(w, cfg.kv_heads, cfg)


def rank_row_block(cfg: Config, tp_rank: int) -> slice:
    """Rank ``tp_rank``'s rows of a grouped checkpoint: ``[r*R/W, (r+1)*R/W)``, ``R`` its rows."""
    check_rank(cfg, tp_rank, "tp_rank")
    if cfg.kv_heads % cfg.world_size:
        raise ValueError(f"kv_heads must be a multiple of world_size for a rank to hold "
                         f"complete groups (got kv_heads={cfg.kv_heads}, "
                         f"world_size={cfg.world_size})")
    n = fused_qkv_rows(cfg) // cfg.world_size
    return slice(tp_rank * n, (tp_rank + 1) * n)


def read_rank_qkv(rows: torch.Tensor, cfg: Config, read_as: str = "grouped"):
    """A rank's ``(wq, wk, wv)`` (``[Hq/W*D, hidden]``, ``[Hkv/W*D, hidden]`` x 2) from its
    fused rows ``[(Hq + 2*Hkv)/W*D, hidden]``: per KV group ``[q x g; k; v]`` (``"grouped"``)
    or as ``[Q; K; V]`` (``"plain"``; the same rows with one group per rank)."""
    _check_layout(read_as, "read_as")
    q, kv = cfg.local_query_heads * cfg.head_dim, cfg.local_kv_heads * cfg.head_dim
    if tuple(rows.shape) != (q + 2 * kv, cfg.hidden):
        raise ValueError(f"rows must be [(query_heads + 2*kv_heads)/world_size*head_dim, "
                         f"hidden] = {[q + 2 * kv, cfg.hidden]} (got {list(rows.shape)})")
    if read_as == "plain":
        return tuple(rows.split([q, kv, kv]))
    return _split_groups(rows, cfg.local_kv_heads, cfg)


def load_qkv_weight(loaded_weight: torch.Tensor, cfg: Config, layout: str = "plain",
                    read_as: str | None = None, **kwargs):
    """Rank ``kwargs.get("tp_rank", 0)``'s ``(wq, wk, wv)`` (vllm-gguf-plugin's default) narrowed
    from the fused ``loaded_weight`` in ``layout``: ``"plain"`` its heads' rows inside each part,
    ``"grouped"`` its ``rank_row_block`` read by ``read_rank_qkv`` as ``read_as`` (default
    ``layout``). Needs ``kv_heads >= world_size``."""
    tp_rank = kwargs.get("tp_rank", 0)
    _check_layout(layout)
    _check_fused(loaded_weight, cfg, "loaded_weight")
    check_rank(cfg, tp_rank, "tp_rank")
    if cfg.kv_heads < cfg.world_size:
        raise ValueError(f"kv_heads must be >= world_size for load_qkv_weight (got "
                         f"kv_heads={cfg.kv_heads}, world_size={cfg.world_size})")
    if layout == "plain":
        if read_as not in (None, "plain"):
            raise ValueError(f"read_as must be 'plain' (or None) for a plain checkpoint "
                             f"(got {read_as!r})")
        wq, wk, wv = split_qkv_weight(loaded_weight, cfg, "plain")
        q, kv = cfg.local_query_heads * cfg.head_dim, cfg.local_kv_heads * cfg.head_dim
        return (wq.narrow(0, tp_rank * q, q), wk.narrow(0, tp_rank * kv, kv),
                wv.narrow(0, tp_rank * kv, kv))
    rows = loaded_weight[rank_row_block(cfg, tp_rank)]
    return read_rank_qkv(rows, cfg, layout if read_as is None else read_as)
