"""Which KV heads and weight rows each TP rank holds when there are fewer KV heads than ranks.

With ``kv_heads < world_size`` each KV head is replicated on ``kv_replicas`` consecutive ranks
(``replicate_weights``), or every rank keeps a slice of the K/V projections and the activations
are all-gathered (``gather_activations``); see ``tpattn.parallel.kv_heads``.
"""
from __future__ import annotations

from tpattn.config import KV_STRATEGIES, Config

REPLICATE_WEIGHTS, GATHER_ACTIVATIONS = KV_STRATEGIES

__all__ = ["REPLICATE_WEIGHTS", "GATHER_ACTIVATIONS", "has_replicas", "kv_head_of_rank",
           "replica_groups", "replica_index", "kv_weight_rows", "is_first_kv_copy",
           "kv_grad_bug_applies"]


def has_replicas(cfg: Config) -> bool:
    """``True`` when ``kv_heads < world_size``: ranks share KV heads (this module's case)."""
    return cfg.kv_heads < cfg.world_size


def _check_rank(cfg: Config, rank: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cfg.world_size:
        raise ValueError(f"rank must be an integer in [0, world_size={cfg.world_size}) (got {rank!r})")
    return rank


def kv_head_of_rank(cfg: Config, rank: int) -> int:
    """The (first) KV head rank ``rank``'s query heads read: ``rank // (W/Hkv)`` when KV heads
    are replicated, else ``rank * Hkv/W``."""
    _check_rank(cfg, rank)
    if has_replicas(cfg):
        return rank // cfg.kv_replicas
    return rank * cfg.local_kv_heads


def replica_groups(cfg: Config) -> list[list[int]]:
    """Ranks holding the same KV head, one list per KV head (``[[0, 1], [2, 3]]`` for 2 KV heads
    on 4 ranks); one rank per group when ``kv_heads >= world_size``."""
    r = cfg.kv_replicas
    return [list(range(g * r, (g + 1) * r)) for g in range(cfg.world_size // r)]


def replica_index(cfg: Config, rank: int) -> int:
    """Position of ``rank`` in its replica group (0: the group's first rank)."""
    return _check_rank(cfg, rank) % cfg.kv_replicas


def kv_weight_rows(cfg: Config, rank: int) -> slice:
    """Rows of wk/wv that rank ``rank`` holds.

    ``kv_heads >= world_size``: its KV heads' rows. Replicated (``replicate_weights``): the rows
    of KV head ``kv_head_of_rank`` — the same rows on every rank of the replica group.
    ``gather_activations``: an equal, disjoint slice ``[r*c, (r+1)*c)``, ``c = Hkv*D/W`` (less
    than a head when ``kv_heads < world_size``).
    """
    d = cfg.head_dim
    if has_replicas(cfg) and cfg.kv_strategy == GATHER_ACTIVATIONS:
        c = cfg.kv_heads * d // cfg.world_size
        return slice(_check_rank(cfg, rank) * c, (rank + 1) * c)
    first, count = kv_head_of_rank(cfg, rank), cfg.local_kv_heads
    return slice(first * d, (first + count) * d)


def is_first_kv_copy(cfg: Config, rank: int) -> bool:
    """Whether rank ``rank``'s wk/wv rows are the first copy of them: ``False`` only for the
    non-first ranks of a replica group under ``replicate_weights`` (``unshard_params`` reads a
    replicated head from its group's first rank)."""
    return not kv_grad_bug_applies(cfg) or replica_index(cfg, rank) == 0


def kv_grad_bug_applies(cfg: Config) -> bool:
    """Whether mode ``missing_kv_grad_reduce`` means anything for ``cfg``: only with replicated
    KV weights (``kv_heads < world_size`` and ``replicate_weights``)."""
    return has_replicas(cfg) and cfg.kv_strategy == REPLICATE_WEIGHTS
