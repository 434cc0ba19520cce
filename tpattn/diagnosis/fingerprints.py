"""Impostors and exact errors (chapter 10): ``IMPOSTORS`` keep both reductions yet share a
missing reduction's signature (its failing measures); its exact error: ``g_fingerprint`` (dense −
TP output is ``Σ_{r≠0} P_r``), ``f_fingerprint`` (dense − TP ``dX`` is ranks ``1..W-1``'s terms
through RMSNorm). Forwards: ``forward(x, params, cfg) -> y``, x and y ``[S, B, hidden]``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpattn.check.core import (PARAM_SEED_OFFSET, TOLERANCE, dense_reference, five_measures,
                               make_inputs, one_step)
from tpattn.config import Config
from tpattn.block.dense import attend_and_project, dense_forward
from tpattn.block.layers import rms_norm
from tpattn.block.params import init_params, shard_params
from tpattn.parallel.tp import copy_to_ranks, reduce_output_partials, tp_forward

__all__ = ["split_group_tp", "f_mean_tp", "g_sums_ybar_tp", "g_missing_tp", "f_missing_tp",
           "IMPOSTORS", "start", "measures", "rank_paths", "g_fingerprint", "f_fingerprint",
           "EXACT_ERROR_TESTS"]


def split_group_tp(x: torch.Tensor, p: dict, cfg: Config | None = None) -> torch.Tensor:
    """Both reductions, but ranks 0 and 1 swap their ``wk``/``wv`` shards."""
    cfg = cfg or Config()
    n = rms_norm(x, p["norm"], cfg.eps)
    shards = shard_params(p, cfg)
    for name in ("wk", "wv"):
        shards[0][name], shards[1][name] = shards[1][name], shards[0][name]
    partials = [attend_and_project(n_r, shard, cfg)
                for n_r, shard in zip(copy_to_ranks(n, cfg.world_size), shards)]
    return x + reduce_output_partials(partials)


def f_mean_tp(x: torch.Tensor, p: dict, cfg: Config | None = None) -> torch.Tensor:
    """Both reductions, but f's backward averages ``dn`` over the ranks instead of summing."""
    cfg = cfg or Config()
    n = rms_norm(x, p["norm"], cfg.eps)
    n.register_hook(lambda grad: grad / cfg.world_size)   # the mean of the ranks' dn
    partials = [attend_and_project(n_r, shard, cfg)
                for n_r, shard in zip(copy_to_ranks(n, cfg.world_size), shard_params(p, cfg))]
    return x + reduce_output_partials(partials)


def g_sums_ybar_tp(x: torch.Tensor, p: dict, cfg: Config | None = None) -> torch.Tensor:
    """Both reductions, but g's backward all-reduces ``ȳ``: every rank holds the same ``ȳ``,
    so each partial receives ``world_size · ȳ`` where g's backward passes ``ȳ`` through."""
    cfg = cfg or Config()
    w = cfg.world_size
    n = rms_norm(x, p["norm"], cfg.eps)
    partials = [attend_and_project(n_r, shard, cfg)
                for n_r, shard in zip(copy_to_ranks(n, w), shard_params(p, cfg))]
    for partial in partials:
        partial.register_hook(lambda grad: grad * w)      # Σ over the ranks of the same ȳ
    return x + reduce_output_partials(partials)


def g_missing_tp(x: torch.Tensor, p: dict, cfg: Config | None = None) -> torch.Tensor:
    """The fixture's block without g (``missing_output_reduce``)."""
    return tp_forward(x, p, cfg or Config(), reduce_output=False)


def f_missing_tp(x: torch.Tensor, p: dict, cfg: Config | None = None) -> torch.Tensor:
    """The fixture's block without f (``missing_input_grad_reduce``)."""
    return tp_forward(x, p, cfg or Config(), reduce_input_grad=False)


#: label -> (forward, the missing reduction whose signature it shows)
IMPOSTORS = {"split head group": (split_group_tp, "missing_output_reduce"),
             "f averages": (f_mean_tp, "missing_input_grad_reduce"),
             "g's backward sums ȳ": (g_sums_ybar_tp, "missing_input_grad_reduce")}


def start(seed: int, cfg: Config | None = None):
    """The fixture's ``(x0, target, params)`` for ``seed``: x0, target ``[S, B, hidden]``."""
    cfg = cfg or Config()
    x0, target = make_inputs(cfg, seed)
    return x0, target, init_params(cfg, seed + PARAM_SEED_OFFSET)


def measures(forward, seed: int, label: str, cfg: Config | None = None) -> dict:
    """The fixture's five measures of any TP ``forward(x, params, cfg)`` against the dense block."""
    cfg = cfg or Config()
    x0, target, base = start(seed, cfg)
    return five_measures(seed, label, dense_reference(x0, target, base, cfg),
                         one_step(lambda x, p: forward(x, p, cfg), x0, target, base))


def rank_paths(seed: int, cfg: Config | None = None):
    """``(x, [P_r], ȳ)`` at the fixture's start: the leaf ``x``, the correct block's partials
    and the loss gradient at its output, all ``[S, B, hidden]``."""
    cfg = cfg or Config()
    x0, target, base = start(seed, cfg)
    x = x0.clone().requires_grad_(True)
    n = rms_norm(x, base["norm"], cfg.eps)
    partials = [attend_and_project(n, shard, cfg) for shard in shard_params(base, cfg)]
    y = (x + sum(partials)).detach().requires_grad_(True)
    grad_y, = torch.autograd.grad(F.mse_loss(y, target), y)
    return x, partials, grad_y


def g_fingerprint(forward, seed: int, cfg: Config | None = None) -> bool:
    """Is dense − TP output exactly the partials of ranks ``1..W-1`` (within ``TOLERANCE``)?"""
    cfg = cfg or Config()
    x0, _, base = start(seed, cfg)
    _, partials, _ = rank_paths(seed, cfg)
    with torch.no_grad():
        error = dense_forward(x0, base, cfg) - forward(x0, base, cfg)
    return torch.allclose(error, sum(partials[1:]).detach(), atol=TOLERANCE, rtol=0)


def f_fingerprint(forward, seed: int, cfg: Config | None = None) -> bool:
    """Is dense − TP ``dX`` exactly ranks ``1..W-1``'s terms through RMSNorm (within
    ``TOLERANCE``)?"""
    cfg = cfg or Config()
    x0, target, base = start(seed, cfg)
    dense = dense_reference(x0, target, base, cfg)["input_grad"]
    tp = one_step(lambda x, p: forward(x, p, cfg), x0, target, base)["input_grad"]
    x, partials, grad_y = rank_paths(seed, cfg)
    missing, = torch.autograd.grad(sum(partials[1:]), x, grad_y)
    return torch.allclose(dense - tp, missing, atol=TOLERANCE, rtol=0)


#: the missing reduction -> the test of its exact error
EXACT_ERROR_TESTS = {"missing_output_reduce": g_fingerprint,
                     "missing_input_grad_reduce": f_fingerprint}
