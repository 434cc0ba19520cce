"""Wrong stages, each a substitution for one stage of the correct ``Program``; ``program_of``
turns an ``Injection``'s knobs into them."""
from __future__ import annotations

from dataclasses import replace

import torch

from .collectives import (G_LABEL, AGAIN, F_LABEL, NORM_GRAD_LABEL, CopyToRanks,
                          GatherSequence, ReduceFromRanks, own_tokens, reduce_dp_grads,
                          reduce_loss)
from .program import CORRECT, Program

__all__ = ["ScaleGrad", "GatherSequenceNoReduce", "no_collective", "f_averaged", "f_twice",
           "g_twice", "tiled_heads", "both_kept", "bias_before_g", "no_bias_after_g",
           "norm_grad_averaged", "grad_squares_per_rank", "MADE_UP_STAGES", "program_of"]


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward the gradient times ``scale`` (``apply(t, scale)``)."""

    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class GatherSequenceNoReduce(GatherSequence):
    """SP's all-gather without its backward reduce: rank r keeps its tokens of its own dn."""

    @staticmethod
    def backward(ctx, dn):
        return own_tokens(dn, ctx.comm, ctx.group).contiguous(), None, None


def no_collective(t: torch.Tensor, comm) -> torch.Tensor:
    """A dropped collective (f, g, SP's norm-gradient all-reduce): ``t`` as it is."""
    return t


def f_averaged(n: torch.Tensor, comm) -> torch.Tensor:
    """f whose backward all-reduce has op AVG (dn summed, then / W)."""
    return CopyToRanks.apply(n, comm, F_LABEL, "avg")


def f_twice(n: torch.Tensor, comm) -> torch.Tensor:
    """f, then a second backward all-reduce of dn."""
    return CopyToRanks.apply(CopyToRanks.apply(n, comm), comm, "all-reduce of dn" + AGAIN)


def g_twice(partial: torch.Tensor, comm) -> torch.Tensor:
    """g applied twice: the output W times the sum of the partials."""
    return ReduceFromRanks.apply(ReduceFromRanks.apply(partial, comm), comm, G_LABEL + AGAIN)


def tiled_heads(t: torch.Tensor, groups: int, ranks: int) -> torch.Tensor:
    """Each rank's KV heads ``[S, B, R*Hkv, D]`` tiled (``[h0, h1, h0, h1]``), not repeated."""
    s, b, _, d = t.shape
    return t.view(s, b, ranks, -1, d).repeat(1, 1, 1, groups, 1).reshape(s, b, -1, d)


def both_kept(a: torch.Tensor, b: torch.Tensor, comm):
    """A pair's reduce dropped (KV replicas' wk/wv, the q/k-norm gradients): both as they are."""
    return a, b


def bias_before_g(partial: torch.Tensor, p: dict, comm) -> torch.Tensor:
    """Every rank adds the row-parallel bias ``[R, hidden]`` to its partial before g."""
    return partial + p["bias"].unsqueeze(1).unsqueeze(1)


def no_bias_after_g(out: torch.Tensor, p: dict) -> torch.Tensor:
    """No bias after g (none in the program, or added before g)."""
    return out


def norm_grad_averaged(grad: torch.Tensor, comm) -> torch.Tensor:
    """SP's norm-gradient all-reduce with op AVG: the TP group's sum / W."""
    comm.record("after backward", NORM_GRAD_LABEL, op="avg")
    return (comm.group_sum(grad, "tp") / comm.world_size).clone()


def grad_squares_per_rank(grads: dict[str, torch.Tensor], comm) -> torch.Tensor:
    """Each rank's sum of squared gradients ``[R]``, replicated parameters on every rank."""
    return torch.as_tensor(sum(g.double().pow(2).flatten(1).sum(1) for g in grads.values()))


def _gather_stage(f: str, group: str):
    """SP's all-gather for f's knob ``f`` over ``group``."""
    if f == "none":
        return lambda n, comm: GatherSequenceNoReduce.apply(n, comm, group)
    if f == "mean":
        return lambda n, comm: ScaleGrad.apply(GatherSequence.apply(n, comm, group),
                                               1.0 / comm.world_size)
    return CORRECT.sp_gather if group == "tp" else \
        (lambda n, comm: GatherSequence.apply(n, comm, group))


#: The made-up bugs' stage factories by ``Injection`` field (filled by ``bugs.made_up``).
MADE_UP_STAGES: dict = {}


def program_of(inj) -> Program:
    """The ``Program`` an ``Injection`` runs: ``CORRECT`` with each wrong knob's stage."""
    s = {"f": {"sum": CORRECT.f, "none": no_collective, "mean": f_averaged,
               "twice": f_twice}[inj.f],
         "g": {1: CORRECT.g, 0: no_collective, 2: g_twice}[inj.g],
         "sp_gather": _gather_stage(inj.f, inj.sp_group),
         "sp_scatter": CORRECT.sp_scatter if inj.g else own_tokens,
         "norm_grad": {"sum": CORRECT.norm_grad, "mean": norm_grad_averaged,
                       "none": no_collective}[inj.norm_grad],
         "clip": inj.clip, "name": repr(inj)}
    if inj.kv == "tile":
        s["repeat_kv"] = tiled_heads
    if inj.kv_grad == "none":
        s["replica_reduce"] = both_kept
    if inj.partial_scale != 1.0:
        s["before_g"] = MADE_UP_STAGES["partial_scale"](inj.partial_scale)
    if inj.bias != "after_g":  # none in the program (any "bias" in p is left out), or before g
        s["add_bias"] = no_bias_after_g
    if inj.bias == "every_rank":
        scaled = s.get("before_g", CORRECT.before_g)
        s["before_g"] = lambda t, p, comm: bias_before_g(scaled(t, p, comm), p, comm)
    if inj.qk_norm_grad == "none":
        s["qk_norm_grads"] = both_kept
    if inj.dp_grad != "dp":
        s["dp_grads"] = lambda grads, comm: reduce_dp_grads(grads, comm, inj.dp_grad)
    if inj.loss_group != "dp":
        s["loss"] = lambda share, comm: reduce_loss(share, comm, inj.loss_group)
    if inj.norm == "per_rank":
        s["grad_squares"] = grad_squares_per_rank
    if inj.rank_lr_scale:
        s["update"] = MADE_UP_STAGES["rank_lr_scale"](inj.rank_lr_scale)
    return replace(CORRECT, **s)
