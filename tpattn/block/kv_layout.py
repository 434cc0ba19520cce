"""Which KV heads and wk/wv rows each TP rank holds (``kv_heads < world_size``: a head
replicated on ``kv_replicas`` ranks, or a slice of it with ``gather_activations``)."""
from __future__ import annotations

from tpattn.config import KV_STRATEGIES, Config

REPLICATE_WEIGHTS, GATHER_ACTIVATIONS = KV_STRATEGIES

__all__ = ["REPLICATE_WEIGHTS", "GATHER_ACTIVATIONS", "has_replicas", "check_rank",
           "kv_head_of_rank", "replica_groups", "replica_index", "kv_weight_rows",
           "is_first_kv_copy", "kv_grad_bug_applies"]


def has_replicas(cfg: Config) -> bool:
    """``kv_heads < world_size``: ranks share KV heads."""
    return cfg.kv_heads < cfg.world_size


def check_rank(cfg: Config, rank, name: str = "rank") -> int:
    """``rank`` if it is an integer in ``[0, world_size)``, else ``ValueError`` naming ``name``."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cfg.world_size:
        raise ValueError(f"{name} must be an integer in [0, world_size={cfg.world_size}) "
                         f"(got {rank!r})")
    return rank


def kv_head_of_rank(cfg: Config, rank: int) -> int:
    """The first KV head of ``rank``: ``rank // (W/Hkv)`` if replicated, else ``rank * Hkv/W``."""
    check_rank(cfg, rank)
    return rank // cfg.kv_replicas if has_replicas(cfg) else rank * cfg.local_kv_heads


def replica_groups(cfg: Config) -> list[list[int]]:
    """The ranks of each KV head (``[[0, 1], [2, 3]]``: 2 heads on 4 ranks)."""
    r = cfg.kv_replicas
    return [list(range(g * r, (g + 1) * r)) for g in range(cfg.world_size // r)]


def replica_index(cfg: Config, rank: int) -> int:
    """Position of ``rank`` in its replica group (0: the group's first rank)."""
    return check_rank(cfg, rank) % cfg.kv_replicas


def kv_weight_rows(cfg: Config, rank: int) -> slice:
    """Rank ``rank``'s wk/wv rows: its KV heads' (``gather_activations``: ``Hkv*D/W`` rows)."""
    d = cfg.head_dim
    if has_replicas(cfg) and cfg.kv_strategy == GATHER_ACTIVATIONS:
        c = cfg.kv_heads * d // cfg.world_size
        return slice(check_rank(cfg, rank) * c, (rank + 1) * c)
    first, count = kv_head_of_rank(cfg, rank), cfg.local_kv_heads
    return slice(first * d, (first + count) * d)


def is_first_kv_copy(cfg: Config, rank: int) -> bool:
    """``False`` only for a non-first rank of a replica group under ``replicate_weights``."""
    return not kv_grad_bug_applies(cfg) or replica_index(cfg, rank) == 0


def kv_grad_bug_applies(cfg: Config) -> bool:
    """Whether KV weights are replicated (``missing_kv_grad_reduce`` applies)."""
    return has_replicas(cfg) and cfg.kv_strategy == REPLICATE_WEIGHTS
