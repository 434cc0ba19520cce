"""The LM's parameters: ``embed`` ``[V, hidden]``; per layer ``layers.{i}.{name}`` the block's
(``tpattn.block.params``) and the MLP's ``mlp_norm`` ``[hidden]``, ``w_gate``, ``w_up``
``[ffn, hidden]``, ``w_down`` ``[hidden, ffn]``, with ``mlp_bias`` also ``b_down`` ``[hidden]``;
``norm`` ``[hidden]``; ``head`` ``[V, hidden]`` unless tied. Sharded: vocabulary rows, ffn rows
of gate/up, ffn columns of down; norms and ``b_down`` replicated."""
from __future__ import annotations

import torch

from tpattn.block.params import INIT_STD, PARAM_NAMES, init_params, shard_params, unshard_params
from .config import LMConfig

__all__ = ["MLP_NAMES", "LAYER_NAMES", "MLP_BIAS", "layer_key", "layer_params", "head_weight",
           "init_lm_params", "shard_lm_params", "unshard_lm_params"]

#: The MLP's parameters in one layer, in the order they are drawn.
MLP_NAMES = ("mlp_norm", "w_gate", "w_up", "w_down")
#: One layer's parameters: the attention block's, then the MLP's.
LAYER_NAMES = PARAM_NAMES + MLP_NAMES
#: The down projection's bias (``LMConfig.mlp_bias``), replicated on every TP rank.
MLP_BIAS = "b_down"
#: The dim each non-attention parameter is cut along across ranks (``None``: replicated).
_SHARD_DIM = {"embed": 0, "head": 0, "w_gate": 0, "w_up": 0, "w_down": 1, "mlp_norm": None,
              "norm": None, MLP_BIAS: None}


def layer_key(i: int, name: str) -> str:
    """The flat name of layer ``i``'s parameter ``name``: ``"layers.{i}.{name}"``."""
    return f"layers.{i}.{name}"


def layer_params(p: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s parameters by their short names (``LAYER_NAMES``, and ``MLP_BIAS`` if
    ``p`` holds it)."""
    names = LAYER_NAMES + ((MLP_BIAS,) if layer_key(i, MLP_BIAS) in p else ())
    return {name: p[layer_key(i, name)] for name in names}


def head_weight(p: dict[str, torch.Tensor], lm: LMConfig) -> torch.Tensor:
    """The LM head ``[.., V, hidden]``: ``embed`` itself when tied, else ``head``."""
    return p["embed"] if lm.tied else p["head"]


def init_lm_params(lm: LMConfig, seed: int) -> dict[str, torch.Tensor]:
    """Parameters from ``seed`` (own generator): matrices ``N(0, 1) * INIT_STD`` drawn in float32
    (embed; per layer a seed for ``init_params``, gate, up, down; head), norms ones; with
    ``mlp_bias`` every layer's ``b_down`` ``N(0, 1) * INIT_STD`` drawn last (after head), keyed
    after its ``w_down``."""
    g = torch.Generator().manual_seed(seed)
    cfg, dtype = lm.block, lm.block.torch_dtype

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * INIT_STD).to(dtype)

    p = {"embed": rand(lm.vocab, cfg.hidden)}
    for i in range(lm.layers):
        block_seed = int(torch.randint(2**62, (1,), generator=g))
        p.update({layer_key(i, k): t for k, t in init_params(cfg, block_seed).items()})
        p[layer_key(i, "mlp_norm")] = torch.ones(cfg.hidden, dtype=dtype)
        p[layer_key(i, "w_gate")] = rand(lm.ffn, cfg.hidden)
        p[layer_key(i, "w_up")] = rand(lm.ffn, cfg.hidden)
        p[layer_key(i, "w_down")] = rand(cfg.hidden, lm.ffn)
    p["norm"] = torch.ones(cfg.hidden, dtype=dtype)
    if not lm.tied:
        p["head"] = rand(lm.vocab, cfg.hidden)
    if lm.mlp_bias:
        biases = {layer_key(i, "w_down"): rand(cfg.hidden) for i in range(lm.layers)}
        p = _with_biases(p, biases)
    return p


def _with_biases(p: dict[str, torch.Tensor],
                 biases: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``p`` with each ``biases`` entry (keyed by its layer's ``w_down``) as that layer's
    ``MLP_BIAS``, right after the ``w_down``."""
    out = {}
    for key, t in p.items():
        out[key] = t
        if key in biases:
            out[key.rsplit(".", 1)[0] + "." + MLP_BIAS] = biases[key]
    return out


def _attention_shards(p: dict[str, torch.Tensor], lm: LMConfig) -> list[dict]:
    """Every layer's ``shard_params`` as one flat dict per rank."""
    shards = [{} for _ in range(lm.block.world_size)]
    for i in range(lm.layers):
        block = {k: p[layer_key(i, k)] for k in PARAM_NAMES}
        for shard, mine in zip(shards, shard_params(block, lm.block)):
            shard.update({layer_key(i, k): t for k, t in mine.items()})
    return shards


def shard_lm_params(p: dict[str, torch.Tensor], lm: LMConfig) -> list[dict[str, torch.Tensor]]:
    """Dense parameters -> one dict of views per rank (keys in ``p``'s order): vocabulary rows,
    ffn rows of gate/up and columns of down, the block's ``shard_params``, norms replicated."""
    attention = _attention_shards(p, lm)
    shards = []
    for rank, mine in enumerate(attention):
        shard = {}
        for key, t in p.items():
            dim = None if key in mine else _SHARD_DIM[key.rsplit(".", 1)[-1]]
            shard[key] = (mine[key] if key in mine else t if dim is None
                          else t.chunk(lm.block.world_size, dim)[rank])
        shards.append(shard)
    return shards


def unshard_lm_params(shards: list[dict[str, torch.Tensor]],
                      lm: LMConfig) -> dict[str, torch.Tensor]:
    """``shard_lm_params``' inverse: new full-size tensors, each replica from rank 0."""
    full = {}
    for key, first in shards[0].items():
        name = key.rsplit(".", 1)[-1]
        if key.startswith("layers.") and name in PARAM_NAMES:
            continue
        dim = _SHARD_DIM[name]
        full[key] = (first.detach().clone() if dim is None
                     else torch.cat([s[key].detach() for s in shards], dim=dim))
    for i in range(lm.layers):
        block = unshard_params([{k: s[layer_key(i, k)] for k in PARAM_NAMES} for s in shards],
                               lm.block)
        full.update({layer_key(i, k): t for k, t in block.items()})
    return {k: full[k] for k in shards[0]}
