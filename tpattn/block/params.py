"""Parameters of the block: deterministic init, trainable copies, and head-group sharding.

Weight layouts follow ``torch.nn.functional.linear`` (``y = x @ w.T``)::

    norm  [hidden]                          RMSNorm scale
    wq    [query_heads * head_dim, hidden]  rows grouped by query head
    wk    [kv_heads * head_dim, hidden]     rows grouped by KV head
    wv    [kv_heads * head_dim, hidden]
    wo    [hidden, query_heads * head_dim]  columns grouped by query head

With ``Config.qk_norm`` two more, replicated like ``norm`` (``QK_NORM_NAMES``)::

    q_norm, k_norm  [head_dim]              RMSNorm scale of each query/key head
"""
from __future__ import annotations

import torch

from tpattn.config import Config
from .kv_layout import is_first_kv_copy, kv_weight_rows

#: Standard deviation of the seed's weight init.
INIT_STD = 0.15

#: Parameter names, in the order the block uses them.
PARAM_NAMES = ("norm", "wq", "wk", "wv", "wo")


#: The q/k-norm weights (``Config.qk_norm``): replicated on every TP rank, as ``norm``.
QK_NORM_NAMES = ("q_norm", "k_norm")


#: ``init_params``'s choices: the seed's fixed 0.15, or ``1/sqrt(fan_in)`` per weight.
INITS = ("seed", "fan_in")


def init_params(cfg: Config, seed: int, init: str = "seed") -> dict[str, torch.Tensor]:
    """Deterministic parameters from ``seed`` (its own generator, global RNG untouched).

    Weights are ``N(0, 1) * 0.15`` drawn in float32 in the order wq, wk, wv, wo, then cast to
    ``cfg.dtype``, so a float64 run sees the same numbers as a float32 one; ``norm`` is ones.

    ``init="fan_in"`` scales the same draws by ``1/sqrt(fan_in)`` instead (fan_in = the
    weight's input size: ``hidden`` for wq/wk/wv, ``query_heads * head_dim`` for wo), so
    activations keep unit size at any width; at hidden 4096 the seed's 0.15 makes attention
    scores of several hundred and a nearly one-hot softmax.
    """
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)} (got {init!r})")
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        std = INIT_STD if init == "seed" else shape[1] ** -0.5
        return (torch.randn(*shape, generator=g) * std).to(cfg.torch_dtype)

    return {
        "norm": torch.ones(cfg.hidden, dtype=cfg.torch_dtype),
        "wq": rand(cfg.query_heads * cfg.head_dim, cfg.hidden),
        "wk": rand(cfg.kv_heads * cfg.head_dim, cfg.hidden),
        "wv": rand(cfg.kv_heads * cfg.head_dim, cfg.hidden),
        "wo": rand(cfg.hidden, cfg.query_heads * cfg.head_dim),
    }


def clone_trainable(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Independent leaf copies with ``requires_grad=True`` (one per model being compared)."""
    return {name: t.clone().detach().requires_grad_(True) for name, t in params.items()}


def rank_head_slices(cfg: Config, rank: int) -> tuple[slice, slice]:
    """Rows of wq (and columns of wo), and rows of wk/wv, that TP rank ``rank`` owns.

    Rank ``r`` owns query heads ``[r*Hq/W, (r+1)*Hq/W)`` and KV heads ``[r*Hkv/W, (r+1)*Hkv/W)``.
    Because ``repeat_kv`` maps query head ``h`` to KV head ``h // (Hq/Hkv)``, those are exactly the
    KV heads its query heads read: every rank holds complete query/KV groups.
    When ``kv_heads < world_size`` the wk/wv rows are ``tpattn.parallel.kv_heads.kv_weight_rows``: a copy
    of KV head ``r // (W/Hkv)`` (``replicate_weights``) or a slice of one (``gather_activations``).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cfg.world_size:
        raise ValueError(f"rank must be an integer in [0, world_size={cfg.world_size}) (got {rank!r})")
    d, q = cfg.head_dim, cfg.local_query_heads
    return slice(rank * q * d, (rank + 1) * q * d), kv_weight_rows(cfg, rank)


def shard_params(params: dict[str, torch.Tensor], cfg: Config) -> list[dict[str, torch.Tensor]]:
    """Split dense parameters into ``cfg.world_size`` rank-local shards (views, not copies).

    - ``wq``, ``wk``, ``wv``: column-parallel — each rank takes the *rows* of its heads;
    - ``wo``: row-parallel — each rank takes the *columns* of its query heads;
    - ``norm`` (and ``q_norm``/``k_norm`` when ``params`` has them): replicated — every rank
      uses the same tensor.

    Slicing is differentiable, so the gradients of the shards land in the dense tensors of
    ``params`` (a copying slice would do the same); that the shards are views only saves memory.
    Returns one dict per rank with the keys of ``params``.
    """
    shards = []
    for rank in range(cfg.world_size):
        q_rows, kv_rows = rank_head_slices(cfg, rank)
        shards.append({
            "norm": params["norm"],
            "wq": params["wq"][q_rows],
            "wk": params["wk"][kv_rows],
            "wv": params["wv"][kv_rows],
            "wo": params["wo"][:, q_rows],
            **{k: params[k] for k in QK_NORM_NAMES if k in params},
        })
    return shards


def unshard_params(shards: list[dict[str, torch.Tensor]], cfg: Config) -> dict[str, torch.Tensor]:
    """The inverse of ``shard_params``: full-size tensors from every rank's own shards.

    Each rank's rows of wq/wk/wv and columns of wo go back where ``rank_head_slices`` took them
    from; ``norm`` is replicated, so rank 0's copy stands for all (whether the replicas still
    agree is a separate question: see ``tpattn.real.ranks.RealRankReport.rank_disagreement``).
    Likewise a replicated KV head (``kv_heads < world_size``) is taken from the first rank of
    its replica group.
    shards: ``world_size`` dicts with the keys of ``PARAM_NAMES`` (and ``QK_NORM_NAMES``,
    replicated: rank 0's copy). Returns new tensors (detached), keyed by ``PARAM_NAMES``
    (then the q/k-norm weights when the shards have them).
    """
    first = shards[0]
    width = cfg.query_heads * cfg.head_dim
    full = {"norm": first["norm"].detach().clone(),
            "wq": first["wq"].new_empty(width, cfg.hidden),
            "wk": first["wk"].new_empty(cfg.kv_heads * cfg.head_dim, cfg.hidden),
            "wv": first["wv"].new_empty(cfg.kv_heads * cfg.head_dim, cfg.hidden),
            "wo": first["wo"].new_empty(cfg.hidden, width)}
    with torch.no_grad():
        for rank, mine in enumerate(shards):
            q_rows, kv_rows = rank_head_slices(cfg, rank)
            full["wq"][q_rows] = mine["wq"]
            if is_first_kv_copy(cfg, rank):
                full["wk"][kv_rows] = mine["wk"]
                full["wv"][kv_rows] = mine["wv"]
            full["wo"][:, q_rows] = mine["wo"]
    for k in QK_NORM_NAMES:
        if k in first:
            full[k] = first[k].detach().clone()
    return {k: full[k] for k in PARAM_NAMES + QK_NORM_NAMES if k in full}
