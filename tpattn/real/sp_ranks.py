"""Sequence parallelism on real ranks (torch.distributed): the all-gather and reduce-scatter
along the sequence as autograd Functions over a process group, the norm gradient's all-reduce,
and one rank's check (``tpattn.parallel.sequence_parallel`` holds the layout and the costs).
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpattn.block.params import clone_trainable, init_params, shard_params, unshard_params
from tpattn.block.sgd import sgd_step
from tpattn.bugs.modes import check_mode, resolve
from tpattn.check.core import (EQUIVALENCE, LR, PARAM_SEED_OFFSET, dense_reference,
                               five_measures, make_inputs)
from tpattn.config import Config
from tpattn.parallel.sequence_parallel import NORM_GRAD_REDUCTIONS, rank_tokens, ring_bytes

from tpattn.parallel.injection import Injection

from .ranks import GATHER_RESULTS, CollectiveLedger, gather_step, rank_disagreement, real_rank_block


#: Labels of the collectives one SP check issues, in the order every rank issues them.
AG_N = "all-gather of n along the sequence (forward)"
RS_OUTPUT = "reduce-scatter of output partials (forward)"
AG_DY = "all-gather of dy (backward of the reduce-scatter)"
RS_DN = "reduce-scatter of dn (backward of the all-gather)"
AR_NORM = "all-reduce of the norm weight's gradient (after backward)"


def planned_sp_collectives(inj: Injection) -> list[str]:
    """The collectives every rank issues, in order, in one SP check of the program ``inj``
    (a mode's ``Injection``; then the gather of results to rank 0): the all-gather of n, the
    reduce-scatter of the partials, in backward their all-gather of dy and reduce-scatter of
    dn, then the norm all-reduce — less the one ``inj`` drops (``norm_grad="mean"`` drops
    none: it divides afterwards)."""
    return ([AG_N] + ([RS_OUTPUT, AG_DY] if inj.g else [])
            + ([RS_DN] if inj.f != "none" else []) + ([AR_NORM] if inj.norm_grad != "none" else [])
            + [GATHER_RESULTS])


class SequenceLedger(CollectiveLedger):
    """``tpattn.real.ranks.CollectiveLedger`` for SP: counts every collective by kind and
    autograd phase (``kinds``, e.g. ``{("all_gather", "forward"): 1}``) and the bytes each
    rank sends (``sent``, ring model ``ring_bytes``); the plan check is the parent's."""

    def start_job(self, job: str, planned: list[str]) -> None:
        super().start_job(job, planned)
        self.kinds, self.sent = Counter(), 0.0

    def _count(self, kind: str, phase: str, full: torch.Tensor, label: str,
               op: str | None = None) -> None:
        self.kinds[kind, phase] += 1
        self.entry(kind, phase, "tp", label, op)
        self.sent += ring_bytes(kind, full.numel() * full.element_size(),
                                dist.get_world_size(self.group))

    def all_reduce(self, tensor: torch.Tensor, phase: str, label: str, op: str = "sum") -> None:
        """Sum ``tensor`` over the ranks, in place (``op="avg"``: then divided by W; the
        entry records ``"avg"``, as ``CollectiveLedger.all_reduce``)."""
        self._count("all_reduce", phase, tensor, label, op)
        self._issue(label, dist.all_reduce, tensor)
        if op == "avg":
            tensor /= dist.get_world_size(self.group)

    def all_gather_seq(self, local: torch.Tensor, phase: str, label: str) -> torch.Tensor:
        """Every rank's ``local`` ``[S/W, ...]`` concatenated in rank order: ``[S, ...]``."""
        local = local.contiguous()
        full = local.new_empty((local.shape[0] * dist.get_world_size(self.group), *local.shape[1:]))
        self._count("all_gather", phase, full, label)
        self._issue(label, dist.all_gather_single, full, local)
        return full

    def reduce_scatter_seq(self, full: torch.Tensor, phase: str, label: str) -> torch.Tensor:
        """This rank's ``[S/W, ...]`` tokens of the sum over ranks of ``full`` ``[S, ...]``."""
        full = full.contiguous()
        local = full.new_empty((full.shape[0] // dist.get_world_size(self.group), *full.shape[1:]))
        self._count("reduce_scatter", phase, full, label, "sum")
        self._issue(label, dist.reduce_scatter_single, local, full)
        return local

    def gather_sequence(self, n_local: torch.Tensor, reduce_grad: bool = True) -> torch.Tensor:
        """``GatherFromSequence``: ``[S/W, B, hidden]`` -> ``[S, B, hidden]`` (``reduce_grad``:
        reduce-scatter the gradient in backward, else keep this rank's tokens of its own)."""
        return GatherFromSequence.apply(n_local, self, reduce_grad)

    def reduce_scatter_sequence(self, partial: torch.Tensor) -> torch.Tensor:
        """``ReduceScatterToSequence``: ``[S, B, hidden]`` -> ``[S/W, B, hidden]``."""
        return ReduceScatterToSequence.apply(partial, self)

    def reduce_norm_grad(self, grad: torch.Tensor, how: str = "sum") -> torch.Tensor:
        """``finalize_norm_grad`` of the ``norm`` gradient ``[hidden]``."""
        return finalize_norm_grad(grad, self, how)

    def finish_job(self) -> dict:
        """Check the job issued exactly its plan; return its counts,
        ``{"<phase> <kind>": n, ..., "bytes_per_rank": sent}``."""
        super().finish_job()
        counts = {f"{phase} {kind}": n for (kind, phase), n in sorted(self.kinds.items())}
        return {**counts, "bytes_per_rank": self.sent}


class GatherFromSequence(torch.autograd.Function):
    """The all-gather that replaces f — forward: all-gather along the sequence; backward:
    reduce-scatter, rank r keeps its tokens of the sum of every rank's ``dn``.

    ``apply(n_local, ledger, reduce_grad)``: ``[S/W, B, hidden]`` → ``[S, B, hidden]``.
    ``reduce_grad=False`` (the ``missing_input_grad_reduce`` bug): the backward keeps this
    rank's tokens of its own ``dn``, no collective.
    """

    @staticmethod
    def forward(ctx, n_local: torch.Tensor, ledger: SequenceLedger, reduce_grad: bool):
        ctx.ledger, ctx.reduce_grad = ledger, reduce_grad
        return ledger.all_gather_seq(n_local, "forward", AG_N)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce_grad:
            return ctx.ledger.reduce_scatter_seq(grad, "backward", RS_DN), None, None
        w, rank = dist.get_world_size(ctx.ledger.group), dist.get_rank(ctx.ledger.group)
        return grad.chunk(w, dim=0)[rank].clone(), None, None


class ReduceScatterToSequence(torch.autograd.Function):
    """The reduce-scatter that replaces g — forward: rank r keeps its tokens of the sum of the
    ranks' output partials; backward: all-gather of ``dy`` along the sequence.

    ``apply(partial, ledger)``: ``[S, B, hidden]`` → ``[S/W, B, hidden]``.
    """

    @staticmethod
    def forward(ctx, partial: torch.Tensor, ledger: SequenceLedger):
        ctx.ledger = ledger
        return ledger.reduce_scatter_seq(partial, "forward", RS_OUTPUT)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.ledger.all_gather_seq(grad, "backward", AG_DY), None


def finalize_norm_grad(grad: torch.Tensor, ledger: SequenceLedger, how: str = "sum") -> torch.Tensor:
    """The ``norm`` gradient after backward on a real rank: all-reduced (``"sum"``), all-reduced
    and divided by W (``"mean"``, the bug of averaging), or left alone (``"none"``)."""
    if how not in NORM_GRAD_REDUCTIONS:
        raise ValueError(f"how must be one of {', '.join(NORM_GRAD_REDUCTIONS)} (got {how!r})")
    grad = grad.clone()
    if how != "none":  # "mean" asks for op AVG (issued as SUM, then / W)
        ledger.all_reduce(grad, "after backward", AR_NORM, op="avg" if how == "mean" else "sum")
    return grad


def sp_rank_check(seed: int, mode: str, cfg: Config, rank: int, ledger: SequenceLedger,
                  device: torch.device | str = "cpu"):
    """One dense-vs-SP step on every rank of the group (``tpattn.real.ranks.rank_check`` for
    SP). Returns ``(metrics, disagreement)`` on rank 0, ``(None, None)`` elsewhere:
    ``metrics`` is ``run(seed, mode, cfg, "ranks")``'s dict; ``disagreement`` holds
    ``norm_grad_max_rank_diff`` and ``norm_after_step_max_rank_diff`` (max abs difference of
    another rank's copy from rank 0's) and ``norm_grad_by_rank`` (every rank's ``norm``
    gradient, as lists). Output and dX are sharded under SP: no copies to compare.
    """
    device = torch.device(device)
    x0, target = (t.to(device) for t in make_inputs(cfg, seed))
    base = {k: v.to(device) for k, v in init_params(cfg, seed + PARAM_SEED_OFFSET).items()}
    inj = resolve(check_mode(mode, cfg), cfg).injection  # under SP: one of SP_MODES
    tokens = rank_tokens(cfg, rank)
    p = clone_trainable(shard_params(base, cfg)[rank])
    x = x0[tokens].clone().requires_grad_(True)
    y = real_rank_block(x, p, cfg, inj, ledger, rank)
    (F.mse_loss(y, target[tokens], reduction="sum") / target.numel()).backward()
    grads = {k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in p.items()}
    grads["norm"] = finalize_norm_grad(grads["norm"], ledger, inj.norm_grad)
    step = {"output": y.detach(), "input_grad": x.grad, "grads": grads,
            "weights": sgd_step(p, grads, LR)}
    gathered = gather_step(ledger, rank, step, lambda per_rank: unshard_params(per_rank, cfg))
    if gathered is None:
        return None, None
    ranks, tp = gathered  # under SP every rank's output and dX are its own tokens
    output = torch.cat([r["output"] for r in ranks])
    tp.update(output=output, loss=F.mse_loss(output, target),
              input_grad=torch.cat([r["input_grad"] for r in ranks]))
    metrics = five_measures(seed, mode, dense_reference(x0, target, base, cfg), tp)
    disagreement = rank_disagreement(seed, mode, ranks, {"norm_grad": "grad_norm",
                                                         "norm_after_step": "weight_norm"})
    disagreement["norm_grad_by_rank"] = [r["grad_norm"].cpu().tolist() for r in ranks]
    return metrics, disagreement


def sp_run_rank(rank: int, plan, device: torch.device | str = "cpu", on_progress=None) -> dict:
    """``tpattn.real.ranks.run_rank`` for a plan whose Config has ``sequence_parallel``: every
    job with ``sp_rank_check``, the ledger per mode (counts by kind and phase, bytes), and the
    DTensor SP cross-check (``tpattn.real.dtensor_sp``) for ``plan.dtensor_seeds``."""
    import time

    if plan.fault:
        raise ValueError("fault injection is not supported under sequence_parallel")
    start = time.monotonic()
    ledger = SequenceLedger()
    out = {"results": [], "rank_disagreement": [], "ledger": [], "dtensor": []}
    counts_by_mode: dict[str, dict] = {}
    for index, (mode, seed) in enumerate(plan.jobs):
        ledger.start_job(f"seed {seed} {mode} (SP)", planned_sp_collectives(resolve(mode, plan.cfg).injection))
        metrics, disagreement = sp_rank_check(seed, mode, plan.cfg, rank, ledger, device)
        counts = ledger.finish_job()
        if rank == 0:
            out["results"].append(metrics)
            out["rank_disagreement"].append(disagreement)
            if counts_by_mode.setdefault(mode, counts) != counts:
                raise RuntimeError(f"collective counts of {mode} differ between seeds")
        if on_progress:
            on_progress(index)
    out["ledger"] = [{"variant": "tpattn SP", "mode": mode, **counts}
                     for mode, counts in counts_by_mode.items()]
    if plan.dtensor_seeds:
        from tpattn.real.dtensor_sp import dtensor_sp_check  # loads torch.distributed.tensor only when used

        dtensor_counts = None
        for seed in plan.dtensor_seeds:
            ledger.start_job(f"seed {seed} DTensor SP", [])
            metrics, counts = dtensor_sp_check(seed, plan.cfg, device)
            out["dtensor"].append(metrics)
            dtensor_counts = dtensor_counts or counts
        out["ledger"].append({"variant": "DTensor SequenceParallel", "mode": EQUIVALENCE,
                              **dtensor_counts})
    if rank != 0:
        out = {}
    out["issued"] = ledger.issued
    out["compute_s"] = time.monotonic() - start
    return out
