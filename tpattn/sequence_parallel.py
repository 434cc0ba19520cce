"""Sequence parallelism (SP): the TP block with the residual stream sharded along the sequence.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), as Megatron-LM runs it with ``--sequence-parallel``. Between blocks, each of
the ``W`` TP ranks holds only its own ``S/W`` consecutive tokens of ``x`` (``[S/W, B, hidden]``),
and RMSNorm runs on those tokens with its weight replicated. Megatron's f and g become::

                 all-gather                                   reduce-scatter
    x_r ─ norm ─ along seq ─┬─ rank 0: Q/K/V ─ attn ─ wo ─┬─ sum, keep ── (+ x_r)
    [S/W]        [S]        └─ rank 1: ...         P_r [S]┘ my S/W tokens
    (backward: reduce-scatter of dn)        (backward: all-gather of dy)

- **all-gather** (replaces f): forward, every rank receives all ``S`` tokens of ``n``;
  backward, a *reduce-scatter*: rank r keeps its tokens of the sum of every rank's ``dn``.
- **reduce-scatter** (replaces g): forward, rank r keeps its tokens of the sum of the ranks'
  output partials; backward, an *all-gather* of ``dy``.
- The attention runs on the gathered sequence, so RoPE sees global positions ``0..S-1``. Code
  that applies RoPE to a rank's own tokens must start at ``r * S/W``
  (``apply_rope(q_r, offset=r * S // W)``; Megatron's ``get_rotary_seq_len`` multiplies the
  local length by the TP size for the same reason).
- The ``norm`` weight sees only the rank's tokens, so its gradient is a **partial sum**: it
  needs an all-reduce over the TP group after the backward pass (Megatron marks such weights
  ``sequence_parallel`` and reduces them in ``finalize_model_grads``). Dropping it
  (``missing_norm_grad_reduce``) or averaging instead of summing (``norm_grad_averaged``) is a
  bug that forward, loss and dX cannot see.

The loss is the global MSE: rank r back-propagates its share ``sum((y_r - t_r)**2) / numel``,
and the reported loss is the MSE of the ranks' outputs put together (no collective in the
block's gradient path).

The block under SP, three ways:

- ``sp_forward`` — the fixture's one-graph model (``simulate="fixture"``), see below;
- every simulated rank its own tensors (``simulate="ranks"``): the engine's block
  (``tpattn.parallel.engine``) under ``Config.sequence_parallel``, whose simulated
  collectives (``tpattn.parallel.collectives``) gather and scatter over the rank dimension;
- ``sp_rank_forward`` — one real ``torch.distributed`` rank (``tpattn.distributed``), the
  collectives ``all_gather_single`` / ``reduce_scatter_single`` (torch 2.13's names for
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; gloo has both on CPU).

**Rank 0's view under SP** (``simulate="fixture"``). The seed's model has one copy of every
tensor; a rank's piece is a view of it, a collective that runs costs nothing (autograd sums the
gradients of every use of a tensor), and a *dropped* collective is modelled as rank 0 sees it:
only rank 0's contribution reaches the shared tensor, ranks 1.. are detached. Under SP that
gives: without the reduce-scatter every token's output is ``x + P_0`` (rank 0's partial);
without the all-gather's backward, ``dn`` holds rank 0's contribution only; without the norm
all-reduce, ``norm``'s gradient is rank 0's tokens' share. The forward output, loss and dX are
the ranks' shards put together. For the seed's three modes this is exactly the TP fixture's
model (SP changes where tensors live, not the arithmetic of one graph), and it is *not* what
real ranks compute for a dropped reduce-scatter or all-gather backward — there rank r uses its
own partial and its own ``dn`` on its own tokens; ``simulate="ranks"`` models that.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .check import (EQUIVALENCE, LR, NATIVE_INJECTIONS, PARAM_SEED_OFFSET, SP_MODES,
                    check_mode, dense_reference, five_measures, make_inputs, max_abs_diff,
                    one_step)
from .config import Config
from .dense import attend_and_project
from .distributed import GATHER_RESULTS, CollectiveLedger
from .layers import rms_norm
from .parallel.engine import ScaleGrad
from .params import PARAM_NAMES, clone_trainable, init_params, shard_params, unshard_params
from .tp import copy_to_ranks, reduce_output_partials

__all__ = [
    "NORM_GRAD_REDUCTIONS", "sp_flags", "rank_tokens",
    "ScaleGrad", "sp_forward", "sp_step",
    "GatherFromSequence", "ReduceScatterToSequence", "SequenceLedger", "sp_rank_forward",
    "finalize_norm_grad", "sp_rank_check", "planned_sp_collectives", "ring_bytes",
    "communication_ledger", "norm_activation_bytes", "sp_run_rank",
]

#: How the ranks' ``norm`` gradients are combined after backward: ``"sum"`` (correct, an
#: all-reduce), ``"mean"`` (the ``norm_grad_averaged`` bug), ``"none"`` (dropped).
NORM_GRAD_REDUCTIONS = ("sum", "mean", "none")


def sp_flags(mode: str) -> tuple[bool, bool, str]:
    """``(reduce_output, reduce_input_grad, norm_grad)`` of an SP ``mode`` (one of ``SP_MODES``)."""
    if mode not in SP_MODES:
        raise ValueError(f"mode must be one of {', '.join(SP_MODES)} (got {mode!r})")
    inj = NATIVE_INJECTIONS[mode]  # the mode's program, looked up once
    return inj.g == 1, inj.f == "sum", inj.norm_grad


def rank_tokens(cfg: Config, rank: int) -> slice:
    """The positions of the sequence rank ``rank`` holds under SP: ``[r*S/W, (r+1)*S/W)``."""
    local = cfg.seq // cfg.world_size
    return slice(rank * local, (rank + 1) * local)


# --- the fixture's one-graph model ------------------------------------------------------

def sp_forward(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config,
               reduce_output: bool = True, reduce_input_grad: bool = True,
               norm_grad: str = "sum") -> torch.Tensor:
    """The SP block as one graph, rank 0's view of every dropped collective (module docstring).

    x: ``[S, B, hidden]``, whose ``S/W``-token chunks are the ranks' shards (views, so dX lands
    in ``x``); ``p``: dense parameters (sharded with ``shard_params``). Returns ``[S, B, hidden]``,
    the ranks' output shards put together.
    """
    w = cfg.world_size
    xs = x.chunk(w, dim=0)  # rank r's tokens
    if norm_grad == "mean":
        norms = [ScaleGrad.apply(p["norm"], 1.0 / w) for _ in range(w)]
    else:  # "none": only rank 0's tokens' contribution reaches the shared weight
        norms = [p["norm"] if norm_grad == "sum" or r == 0 else p["norm"].detach() for r in range(w)]
    n = torch.cat([rms_norm(x_r, norm_r, cfg.eps) for x_r, norm_r in zip(xs, norms)])  # all-gather
    inputs = copy_to_ranks(n, w, reduce_grad=reduce_input_grad)  # its backward: reduce-scatter
    partials = [attend_and_project(n_r, shard, cfg) for n_r, shard in zip(inputs, shard_params(p, cfg))]
    summed = reduce_output_partials(partials, reduce=reduce_output)  # reduce-scatter: sum ...
    return torch.cat([x_r + out_r for x_r, out_r in zip(xs, summed.chunk(w, dim=0))])  # ... keep mine


def sp_step(x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor], cfg: Config,
            mode: str) -> dict:
    """The TP side of ``run(simulate="fixture")`` under ``cfg.sequence_parallel``: one step of
    ``sp_forward``, in ``one_step``'s dict (every simulated rank its own step is the engine's,
    ``tpattn.parallel.simulated``)."""
    reduce_output, reduce_input_grad, norm_grad = sp_flags(mode)
    return one_step(lambda x, p: sp_forward(x, p, cfg, reduce_output, reduce_input_grad, norm_grad),
                    x0, target, base)


# --- real ranks (torch.distributed) -----------------------------------------------------

#: Labels of the collectives one SP check issues, in the order every rank issues them.
AG_N = "all-gather of n along the sequence (forward)"
RS_OUTPUT = "reduce-scatter of output partials (forward)"
AG_DY = "all-gather of dy (backward of the reduce-scatter)"
RS_DN = "reduce-scatter of dn (backward of the all-gather)"
AR_NORM = "all-reduce of the norm weight's gradient (after backward)"


def planned_sp_collectives(mode: str) -> list[str]:
    """The collectives every rank issues, in order, in one SP check of ``mode`` (then the
    gather of results to rank 0): the all-gather of n, the reduce-scatter of the partials,
    in backward their all-gather of dy and reduce-scatter of dn, then the norm all-reduce —
    less the one ``mode`` drops (``norm_grad_averaged`` drops none: it divides afterwards)."""
    reduce_output, reduce_input_grad, norm_grad = sp_flags(mode)
    return ([AG_N] + ([RS_OUTPUT, AG_DY] if reduce_output else [])
            + ([RS_DN] if reduce_input_grad else []) + ([AR_NORM] if norm_grad != "none" else [])
            + [GATHER_RESULTS])


def ring_bytes(collective: str, full_bytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring implementation of ``collective`` over a tensor of
    ``full_bytes`` (the whole, un-scattered tensor): ``all_reduce`` 2(W-1)/W of it,
    ``all_gather`` and ``reduce_scatter`` (W-1)/W — an all-reduce *is* a reduce-scatter
    followed by an all-gather."""
    share = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    if collective not in share:
        raise ValueError(f"collective must be one of {', '.join(share)} (got {collective!r})")
    return share[collective] * (world_size - 1) * full_bytes / world_size


def communication_ledger(cfg: Config) -> list[dict]:
    """The collectives one correct training step of the block issues, without and with SP.

    One row per collective: ``variant`` (``"TP"``/``"SP"``), ``collective``, ``phase``,
    ``elements`` of the whole tensor and ``bytes_per_rank`` sent (``ring_bytes``). TP: g's and
    f's all-reduces of ``[S, B, hidden]``. SP: two all-gathers and two reduce-scatters of the
    same size, plus the all-reduce of the ``norm`` gradient (``[hidden]``).
    """
    w, item = cfg.world_size, torch.empty((), dtype=cfg.torch_dtype).element_size()
    act, hid = cfg.seq * cfg.batch * cfg.hidden, cfg.hidden
    rows = [("TP", "all_reduce", "forward", act, "g: sum of output partials"),
            ("TP", "all_reduce", "backward", act, "f: sum of dn"),
            ("SP", "all_gather", "forward", act, "n along the sequence"),
            ("SP", "reduce_scatter", "forward", act, "output partials"),
            ("SP", "all_gather", "backward", act, "dy (reduce-scatter's backward)"),
            ("SP", "reduce_scatter", "backward", act, "dn (all-gather's backward)"),
            ("SP", "all_reduce", "after backward", hid, "norm weight's gradient")]
    return [{"variant": v, "collective": c, "phase": p, "what": what, "elements": n,
             "bytes_per_rank": ring_bytes(c, n * item, w)} for v, c, p, n, what in rows]


def norm_activation_bytes(cfg: Config) -> int:
    """Bytes one rank's RMSNorm saves for backward (its activations; the weight excluded),
    measured with ``torch.autograd.graph.saved_tensors_hooks`` on ``cfg.local_seq`` tokens."""
    x = torch.randn(cfg.local_seq, cfg.batch, cfg.hidden, dtype=cfg.torch_dtype, requires_grad=True)
    weight = torch.ones(cfg.hidden, dtype=cfg.torch_dtype, requires_grad=True)
    saved = []

    def pack(t):
        if t.data_ptr() != weight.data_ptr():
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rms_norm(x, weight, cfg.eps)
    return sum(saved)


class SequenceLedger(CollectiveLedger):
    """``tpattn.distributed.CollectiveLedger`` for SP: counts every collective by kind and
    autograd phase (``kinds``, e.g. ``{("all_gather", "forward"): 1}``) and the bytes each
    rank sends (``sent``, ring model ``ring_bytes``); the plan check is the parent's."""

    def start_job(self, job: str, planned: list[str]) -> None:
        super().start_job(job, planned)
        self.kinds, self.sent = Counter(), 0.0

    def _count(self, kind: str, phase: str, full: torch.Tensor) -> None:
        self.kinds[kind, phase] += 1
        self.sent += ring_bytes(kind, full.numel() * full.element_size(),
                                dist.get_world_size(self.group))

    def all_reduce(self, tensor: torch.Tensor, phase: str, label: str) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        self._count("all_reduce", phase, tensor)
        self._issue(label, dist.all_reduce, tensor)

    def all_gather_seq(self, local: torch.Tensor, phase: str, label: str) -> torch.Tensor:
        """Every rank's ``local`` ``[S/W, ...]`` concatenated in rank order: ``[S, ...]``."""
        local = local.contiguous()
        full = local.new_empty((local.shape[0] * dist.get_world_size(self.group), *local.shape[1:]))
        self._count("all_gather", phase, full)
        self._issue(label, dist.all_gather_single, full, local)
        return full

    def reduce_scatter_seq(self, full: torch.Tensor, phase: str, label: str) -> torch.Tensor:
        """This rank's ``[S/W, ...]`` tokens of the sum over ranks of ``full`` ``[S, ...]``."""
        full = full.contiguous()
        local = full.new_empty((full.shape[0] // dist.get_world_size(self.group), *full.shape[1:]))
        self._count("reduce_scatter", phase, full)
        self._issue(label, dist.reduce_scatter_single, local, full)
        return local

    def gather_sequence(self, n_local: torch.Tensor, reduce_grad: bool = True) -> torch.Tensor:
        """``GatherFromSequence``: ``[S/W, B, hidden]`` -> ``[S, B, hidden]`` (``reduce_grad``:
        reduce-scatter the gradient in backward, else keep this rank's tokens of its own)."""
        return GatherFromSequence.apply(n_local, self, reduce_grad)

    def reduce_scatter_sequence(self, partial: torch.Tensor) -> torch.Tensor:
        """``ReduceScatterToSequence``: ``[S, B, hidden]`` -> ``[S/W, B, hidden]``."""
        return ReduceScatterToSequence.apply(partial, self)

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


def sp_rank_forward(x: torch.Tensor, shard: dict[str, torch.Tensor], cfg: Config,
                    ledger: SequenceLedger, reduce_output: bool = True,
                    reduce_input_grad: bool = True) -> torch.Tensor:
    """This real rank's share of the SP block: its own tokens' output.

    x: ``[S/W, B, hidden]``, this rank's tokens; ``shard``: its ``norm`` (replicated) and
    head-group shards. Returns ``[S/W, B, hidden]``. ``reduce_output=False`` drops the
    reduce-scatter (this rank keeps its tokens of its own partial); ``reduce_input_grad=False``
    drops the all-gather's backward reduce-scatter. ``ledger``: the collectives
    (``gather_sequence``, ``reduce_scatter_sequence``; ``tpattn.typecheck`` passes typed ones).
    """
    n = rms_norm(x, shard["norm"], cfg.eps)  # this rank's tokens only
    n_full = ledger.gather_sequence(n, reduce_input_grad)  # [S]: RoPE sees 0..S-1
    partial = attend_and_project(n_full, shard, cfg)
    if reduce_output:
        return x + ledger.reduce_scatter_sequence(partial)
    return x + partial[rank_tokens(cfg, ledger.rank())]


def finalize_norm_grad(grad: torch.Tensor, ledger: SequenceLedger, how: str = "sum") -> torch.Tensor:
    """The ``norm`` gradient after backward on a real rank: all-reduced (``"sum"``), all-reduced
    and divided by W (``"mean"``, the bug of averaging), or left alone (``"none"``)."""
    if how not in NORM_GRAD_REDUCTIONS:
        raise ValueError(f"how must be one of {', '.join(NORM_GRAD_REDUCTIONS)} (got {how!r})")
    grad = grad.clone()
    if how != "none":
        ledger.all_reduce(grad, "after backward", AR_NORM)
    if how == "mean":
        grad /= dist.get_world_size(ledger.group)
    return grad


def sp_rank_check(seed: int, mode: str, cfg: Config, rank: int, ledger: SequenceLedger,
                  device: torch.device | str = "cpu"):
    """One dense-vs-SP step on every rank of the group (``tpattn.distributed.rank_check`` for
    SP). Returns ``(metrics, disagreement)`` on rank 0, ``(None, None)`` elsewhere:
    ``metrics`` is ``run(seed, mode, cfg, "ranks")``'s dict; ``disagreement`` holds
    ``norm_grad_max_rank_diff`` and ``norm_after_step_max_rank_diff`` (max abs difference of
    another rank's copy from rank 0's) and ``norm_grad_by_rank`` (every rank's ``norm``
    gradient, as lists). Output and dX are sharded under SP: no copies to compare.
    """
    device = torch.device(device)
    x0, target = (t.to(device) for t in make_inputs(cfg, seed))
    base = {k: v.to(device) for k, v in init_params(cfg, seed + PARAM_SEED_OFFSET).items()}
    reduce_output, reduce_input_grad, norm_grad = sp_flags(check_mode(mode, cfg))
    tokens = rank_tokens(cfg, rank)
    p = clone_trainable(shard_params(base, cfg)[rank])
    x = x0[tokens].clone().requires_grad_(True)
    y = sp_rank_forward(x, p, cfg, ledger, reduce_output, reduce_input_grad)
    (F.mse_loss(y, target[tokens], reduction="sum") / target.numel()).backward()
    grads = {k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in p.items()}
    grads["norm"] = finalize_norm_grad(grads["norm"], ledger, norm_grad)
    with torch.no_grad():
        weights = {k: p[k] - LR * grads[k] for k in p}
    mine = {"output": y.detach(), "input_grad": x.grad,
            **{"grad_" + k: g for k, g in grads.items()},
            **{"weight_" + k: w for k, w in weights.items()}}
    ranks = ledger.gather_tensors(mine)
    if rank != 0:
        return None, None
    output = torch.cat([r["output"] for r in ranks])
    tp = {"output": output, "loss": F.mse_loss(output, target),
          "input_grad": torch.cat([r["input_grad"] for r in ranks]),
          "grads": unshard_params([{k: r["grad_" + k] for k in PARAM_NAMES} for r in ranks], cfg),
          "weights": unshard_params([{k: r["weight_" + k] for k in PARAM_NAMES} for r in ranks], cfg)}
    metrics = five_measures(seed, mode, dense_reference(x0, target, base, cfg), tp)
    disagreement = {
        "seed": seed, "mode": mode,
        "norm_grad_max_rank_diff": max(max_abs_diff(r["grad_norm"], ranks[0]["grad_norm"]) for r in ranks),
        "norm_after_step_max_rank_diff": max(max_abs_diff(r["weight_norm"], ranks[0]["weight_norm"])
                                             for r in ranks),
        "norm_grad_by_rank": [r["grad_norm"].cpu().tolist() for r in ranks]}
    return metrics, disagreement


def sp_run_rank(rank: int, plan, device: torch.device | str = "cpu", on_progress=None) -> dict:
    """``tpattn.distributed.run_rank`` for a plan whose Config has ``sequence_parallel``: every
    job with ``sp_rank_check``, the ledger per mode (counts by kind and phase, bytes), and the
    DTensor SP cross-check (``tpattn.dtensor_sp``) for ``plan.dtensor_seeds``."""
    import time

    if plan.fault:
        raise ValueError("fault injection is not supported under sequence_parallel")
    start = time.monotonic()
    ledger = SequenceLedger()
    out = {"results": [], "rank_disagreement": [], "ledger": [], "dtensor": []}
    counts_by_mode: dict[str, dict] = {}
    for index, (mode, seed) in enumerate(plan.jobs):
        ledger.start_job(f"seed {seed} {mode} (SP)", planned_sp_collectives(mode))
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
        from .dtensor_sp import dtensor_sp_check  # loads torch.distributed.tensor only when used

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
