"""``Program``: the stages the per-rank block and its step run, each called with the ranks'
tensors and the backend ``comm``; the defaults are correct TP, a bug replaces one stage."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from tpattn.block.layers import repeat_kv
from tpattn.block.sgd import sgd_step
from .collectives import (CopyToRanks, GatherKV, GatherSequence, ReduceFromRanks,
                          ReduceReplicaGrads, ScatterSequence, reduce_dp_grads, reduce_loss,
                          reduce_norm_grad, reduce_qk_norm_grads)

__all__ = ["Program", "CORRECT", "REPLICATED", "repeat_heads", "keep_partials",
           "add_bias_after_g", "grad_squares", "sgd_ranks"]

#: Parameters every TP rank holds whole (counted once in the gradient norm).
REPLICATED = ("norm", "bias", "q_norm", "k_norm")


def repeat_heads(t: torch.Tensor, groups: int, ranks: int) -> torch.Tensor:
    """``repeat_kv`` on every rank's KV heads ``[S, B, R*Hkv, D]`` (rank-major)."""
    return repeat_kv(t, groups)


def keep_partials(partial: torch.Tensor, p: dict, comm) -> torch.Tensor:
    """The ranks' output partials ``[R, S, B, hidden]`` as they are, before g."""
    return partial


def add_bias_after_g(out: torch.Tensor, p: dict) -> torch.Tensor:
    """``out`` ``[R, S_r, B, hidden]`` plus the bias ``[R, hidden]`` if ``p`` has one."""
    return out + p["bias"].unsqueeze(1).unsqueeze(1) if "bias" in p else out


def grad_squares(grads: dict[str, torch.Tensor], comm) -> torch.Tensor:
    """Each rank's squared gradients summed, ``[R]`` float64 (``REPLICATED`` ones on TP rank 0)."""
    first = torch.tensor(comm.ranks) == 0
    squares = 0.0
    for name, g in grads.items():
        s = g.double().pow(2).flatten(1).sum(1)
        squares = squares + (s * first if name in REPLICATED else s)
    return torch.as_tensor(squares)


def sgd_ranks(ps: dict, grads: dict, lr: float, coefs: list[float], comm) -> dict:
    """Every rank's ``sgd_step`` (scale ``coefs[i]``): the new weights ``[R, ...]``."""
    per_rank = [sgd_step({k: t[i] for k, t in ps.items()}, {k: g[i] for k, g in grads.items()},
                         lr, coefs[i]) for i in range(len(comm.ranks))]
    return {k: torch.stack([w[k] for w in per_rank]) for k in ps}


@dataclass(frozen=True)
class Program:
    """The block's stages (``f`` .. ``add_bias``) and the step's (``norm_grad`` .. ``update``)."""

    f: Callable = CopyToRanks.apply
    g: Callable = ReduceFromRanks.apply
    sp_gather: Callable = GatherSequence.apply
    sp_scatter: Callable = ScatterSequence.apply
    kv_gather: Callable = GatherKV.apply
    replica_reduce: Callable = ReduceReplicaGrads.apply
    repeat_kv: Callable = repeat_heads
    before_g: Callable = keep_partials
    add_bias: Callable = add_bias_after_g
    norm_grad: Callable = reduce_norm_grad
    qk_norm_grads: Callable = reduce_qk_norm_grads
    dp_grads: Callable = reduce_dp_grads
    loss: Callable = reduce_loss
    grad_squares: Callable = grad_squares
    update: Callable = sgd_ranks
    clip: bool = False
    name: str = field(default="correct", compare=False)


#: Correct TP.
CORRECT = Program()
