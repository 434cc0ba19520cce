"""The block's parameters: deterministic init, trainable copies, head-group sharding, in
``F.linear`` layouts: ``norm`` ``[hidden]``, ``wq`` ``[Hq*D, hidden]``, ``wk``, ``wv``
``[Hkv*D, hidden]`` (rows by head), ``wo`` ``[hidden, Hq*D]``, ``q_norm``, ``k_norm`` ``[D]``."""
from __future__ import annotations

import torch

from tpattn.config import Config
from .kv_layout import check_rank, is_first_kv_copy, kv_weight_rows

#: Standard deviation of the original fixture's weight init.
INIT_STD = 0.15
#: Parameter names, in the order the block uses them.
PARAM_NAMES = ("norm", "wq", "wk", "wv", "wo")
#: The q/k-norm weights (``Config.qk_norm``): replicated on every TP rank, as ``norm``.
QK_NORM_NAMES = ("q_norm", "k_norm")
#: ``init_params``'s choices: the original fixture's fixed 0.15, or ``1/sqrt(fan_in)``.
INITS = ("seed", "fan_in")


def init_params(cfg: Config, seed: int, init: str = "seed") -> dict[str, torch.Tensor]:
    """Parameters from ``seed`` (own generator): ``N(0, 1) * 0.15`` drawn in float32 in the
    order wq, wk, wv, wo, cast to ``cfg.dtype``; ``norm`` ones. ``init="fan_in"``: the same
    draws times ``1/sqrt(fan_in)`` (``hidden``, or ``Hq*D`` for wo)."""
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)} (got {init!r})")
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        std = INIT_STD if init == "seed" else shape[1] ** -0.5
        return (torch.randn(*shape, generator=g) * std).to(cfg.torch_dtype)

    shapes = dense_shapes(cfg)  # drawn in PARAM_NAMES' order
    return {"norm": torch.ones(cfg.hidden, dtype=cfg.torch_dtype),
            **{k: rand(*shapes[k]) for k in PARAM_NAMES[1:]}}


def dense_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The dense parameters' shapes, the ``F.linear`` layouts of this module's docstring."""
    q, kv = cfg.query_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return {"norm": (cfg.hidden,), "wq": (q, cfg.hidden), "wk": (kv, cfg.hidden),
            "wv": (kv, cfg.hidden), "wo": (cfg.hidden, q)}


def clone_trainable(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Independent leaf copies with ``requires_grad=True``."""
    return {name: t.clone().detach().requires_grad_(True) for name, t in params.items()}


def rank_head_slices(cfg: Config, rank: int) -> tuple[slice, slice]:
    """Rank ``rank``'s rows of wq (columns of wo) and ``kv_weight_rows`` of wk/wv."""
    check_rank(cfg, rank)
    d, q = cfg.head_dim, cfg.local_query_heads
    return slice(rank * q * d, (rank + 1) * q * d), kv_weight_rows(cfg, rank)


def shard_params(params: dict[str, torch.Tensor], cfg: Config) -> list[dict[str, torch.Tensor]]:
    """Dense parameters -> one shard dict of views per rank: wq, wk, wv rows and wo columns of
    its heads, ``norm`` (and q/k-norm) replicated. Gradients of the shards land in ``params``."""
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
    """``shard_params``' inverse: new full-size tensors, each replica from its first rank."""
    first = shards[0]
    full = {k: first[k].new_empty(shape) for k, shape in dense_shapes(cfg).items()}
    full.update({k: first[k].detach().clone() for k in ("norm",) + QK_NORM_NAMES if k in first})
    with torch.no_grad():
        for rank, mine in enumerate(shards):
            q_rows, kv_rows = rank_head_slices(cfg, rank)
            full["wq"][q_rows] = mine["wq"]
            if is_first_kv_copy(cfg, rank):
                full["wk"][kv_rows] = mine["wk"]
                full["wv"][kv_rows] = mine["wv"]
            full["wo"][:, q_rows] = mine["wo"]
    return {k: full[k] for k in PARAM_NAMES + QK_NORM_NAMES if k in full}
