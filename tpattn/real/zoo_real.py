"""The zoo's bugs on real ranks: one torch.distributed process per TP rank.

``tpattn.real.ranks`` hands every registry mode that is not one of the seed's three to
``zoo_rank_check``: each rank loads its own shard from the full checkpoint with the mode's
loader (``zoo.load_rank_shard``: a fused QKV checkpoint through
``block.fused_qkv.load_qkv_weight``, called with the rank's ``tp_rank`` or, for
``qkv_loaded_from_rank0``, without it), runs ``tpattn.parallel.engine.rank_block`` wired as
the mode's injection with real collectives (``tpattn.real.ranks.real_rank_block``:
``CopyToRanks`` for f, ``ReduceOutputPartials`` for g, each as many times as the bug
issues it), its own loss, backward, the gradient norm (all-reduced when the mode clips) and
its SGD step; rank 0 gathers the shards and compares with the dense block on the five
measures — the same dict as ``tpattn.run(seed, mode, cfg, simulate="ranks")``, equal within
float32 rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpattn.check.core import LR, check_seed, dropout_masks, five_measures, make_inputs
from tpattn.config import Config
from tpattn.block.params import QK_NORM_NAMES
from tpattn.block.sgd import sgd_step
from tpattn.parallel.collectives import QK_NORM_GRAD_LABEL
from tpattn.parallel.engine import reduce_qk_norm_grads
from tpattn.parallel.rng import process_streams
from .ranks import (F_ALL_REDUCE, G_ALL_REDUCE, GATHER_RESULTS, REPLICATED as REPLICATED_TENSORS,
                    CollectiveLedger, DistributedRanks, gather_step, rank_disagreement,
                    real_rank_block)
from tpattn.bugs.zoo import (REPLICATED as REPLICATED_PARAMS, Injection, clip_coef,
                             dense_step, check_needs, get_mode, load_rank_shard, make_params,
                             rank_batches, unshard)

__all__ = ["planned_collectives", "zoo_rank_check", "GRAD_NORM_ALL_REDUCE"]

#: Label of the all-reduce of the squared gradient norms (modes that clip).
GRAD_NORM_ALL_REDUCE = "all-reduce of squared gradient norms"


def _f_count(inj: Injection) -> int:
    return {"none": 0, "twice": 2}.get(inj.f, 1)


def planned_collectives(mode: str, cfg: Config | None = None) -> list[str]:
    """The collectives every rank issues, in order, in one check of registry ``mode``: g as
    many times as the bug applies it, f likewise, with ``cfg.qk_norm`` the after-backward
    all-reduce of the q/k-norm gradients (unless the bug skips it), the gradient-norm
    all-reduce if it clips, then the gather of results to rank 0."""
    inj = (get_mode(mode) if cfg is None else check_needs(mode, cfg)).injection
    if inj is None:
        raise ValueError(f"mode {mode!r} has no injection in tpattn.bugs.zoo")
    qk = [QK_NORM_GRAD_LABEL] if cfg is not None and cfg.qk_norm \
        and inj.qk_norm_grad == "sum" else []
    return ([G_ALL_REDUCE] * inj.g + [F_ALL_REDUCE] * _f_count(inj) + qk
            + ([GRAD_NORM_ALL_REDUCE] if inj.clip else []) + [GATHER_RESULTS])


def zoo_rank_check(seed: int, mode: str, cfg: Config, rank: int, ledger: CollectiveLedger,
                   device: torch.device | str = "cpu"):
    """``distributed.rank_check`` for a registry mode: ``(metrics, disagreement)`` on rank 0,
    ``(None, None)`` elsewhere."""
    check_seed(seed)
    inj = check_needs(mode, cfg).injection
    device = torch.device(device)
    base = {k: v.to(device) for k, v in make_params(cfg, seed, inj).items()}
    mine_params = {k: t.detach().clone().requires_grad_(True)
                   for k, t in load_rank_shard(base, cfg, inj, rank).items()}
    x_r, target_r = (t.to(device) for t in rank_batches(cfg, seed, inj)[rank])
    # with dropout: torch's global RNG seeded on every rank, the tracker's own generator
    rng = process_streams(cfg, seed, rank, inj) if cfg.dropout > 0 else None
    x = x_r.clone().requires_grad_(True)
    y = real_rank_block(x, mine_params, cfg, inj, ledger, rank, rng)
    loss = F.mse_loss(y, target_r)
    loss.backward()
    grads = {k: t.grad if t.grad is not None else torch.zeros_like(t)
             for k, t in mine_params.items()}
    if cfg.qk_norm:  # after backward: the replicated q/k-norm gradients' TP all-reduce
        stacked = {k: grads[k].unsqueeze(0) for k in QK_NORM_NAMES}
        reduce_qk_norm_grads(stacked, cfg, inj, DistributedRanks(cfg, ledger, rank))
        grads.update({k: g[0] for k, g in stacked.items()})
    coef = 1.0
    if inj.clip:  # each rank's share of the squared norm, summed over the ranks
        square = sum(g.double().pow(2).sum() for k, g in grads.items()
                     if k not in REPLICATED_PARAMS or rank == 0 or inj.norm == "per_rank")
        total = DistributedRanks(cfg, ledger, rank).reduce_scalar(square, GRAD_NORM_ALL_REDUCE)
        coef = clip_coef(total.sqrt(), inj)
    step = {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad, "grads": grads,
            "weights": sgd_step(mine_params, grads, LR, float(coef))}
    gathered = gather_step(ledger, rank, step, lambda per_rank: unshard(per_rank, cfg, inj))
    if gathered is None:
        return None, None
    ranks, tp = gathered
    x0, target = (t.to(device) for t in make_inputs(cfg, seed))
    dense = dense_step(x0, target, base, cfg, inj, dropout_masks(cfg, seed))
    metrics = five_measures(seed, mode, dense, tp)
    replicated = dict(REPLICATED_TENSORS)
    if cfg.qk_norm:
        replicated.update({f"{k}_after_step": f"weight_{k}" for k in QK_NORM_NAMES})
    return metrics, rank_disagreement(seed, mode, ranks, replicated)
