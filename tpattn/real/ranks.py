"""The same check on real ranks: one torch.distributed process per TP rank.

``tpattn.parallel.tp`` simulates the ranks in one process, where autograd does the backward half of each
collective for free. Here every rank is a process holding only its own shards, and Megatron's
two operations are ``torch.autograd.Function`` subclasses that call real collectives (in
Megatron-LM, ``tensor_parallel/mappings.py``'s ``copy_to_tensor_model_parallel_region`` and
``reduce_from_tensor_model_parallel_region``; Megatron-Core's ``tensor_parallel/layers.py``
also does f without ``mappings.py``: ``ColumnParallelLinear`` with ``allreduce_dgrad`` has
``LinearWithGradAccumulationAndAsyncCommunication``'s backward all-reduce the input gradient)::

    f  CopyToRanks            forward:  identity
                              backward: all-reduce (sum of the ranks' dn)
    g  ReduceOutputPartials   forward:  all-reduce
                              backward: identity

(``dn = ∂L/∂n`` is the gradient at the input of the sharded region, after RMSNorm. The input
gradient dX = dy + RMSNorm's backward of the summed dn is never all-reduced.)

Each rank builds the same inputs and weights from the seed, runs forward (the simulated
ranks' block, ``tpattn.parallel.engine.rank_block``, on its one local rank:
``real_rank_block``, collectives from ``DistributedRanks``), its own MSE loss, backward and
one SGD step; rank 0 gathers the shards and compares them with the dense block on
the five measures of ``tpattn.run`` (same dict). The bug modes drop g or f on every rank.

What only real ranks show (``RealRankReport``): the ranks' own copies of the output, of dX and
of the ``norm`` gradient can disagree; and every collective is counted (the *ledger*).

With fewer KV heads than ranks (``tpattn.parallel.kv_heads``) every rank also makes the replica groups
with ``dist.new_group`` (all groups, same order, on every rank) and the KV collectives of
``Config.kv_strategy`` join the ledger: the wk/wv gradient all-reduce within the replica group,
or the K/V all-gather and its reduce-scatter (``RealRankReport.traffic`` lists their sizes).

Launch it with ``torchrun --standalone --nproc-per-node N -m tpattn.distributed [flags]``
(``python -m tpattn``'s flags and JSON, plus ``--timeout``), or from Python with
``run_distributed(world_size, seeds, modes, config)``, which starts the ranks itself.
Backend: gloo on CPU; NCCL when ``torch.cuda.device_count() >= world_size``. Every collective
has a timeout (default 60 s, never gloo's 30 minutes); a rank that raises, dies or skips a
collective ends the whole run with one line naming the rank.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from tpattn.check.core import (EQUIVALENCE, MODES, PARAM_SEED_OFFSET, SEEDS, check_seed,
                    dense_reference, five_measures, inspect_fixture, make_inputs,
                    max_abs_diff, one_step)
from tpattn.bugs.modes import resolve
from tpattn.config import Config
from tpattn.parallel.collectives import QK_NORM_GRAD_LABEL
from tpattn.parallel.engine import rank_block
from tpattn.parallel.injection import Injection
from tpattn.parallel.kv_heads import (GATHER_ACTIVATIONS, KV_ALL_GATHER, KV_GRAD_ALL_REDUCE, KV_REDUCE_SCATTER,
                       AllGatherKV, ReplicaGradReduce, has_replicas, kv_grad_bug_applies,
                       replica_groups)
from tpattn.parallel.sequence_parallel import rank_tokens
from .launch import (RankFailure, backend_message, default_backend, describe_error,
                     pin_gloo_to_loopback, rank_device, run_on_ranks)
from tpattn.block.params import init_params, shard_params, unshard_params

__all__ = [
    "CollectiveLedger", "CopyToRanks", "ReduceOutputPartials", "DistributedRanks",
    "real_rank_block", "gather_step", "rank_disagreement",
    "rank_check", "five_measures", "dense_reference", "planned_collectives", "run_rank",
    "RunPlan", "run_distributed", "RealRankReport", "RankFailure",
    "default_backend", "DEFAULT_TIMEOUT", "FAULT_KINDS", "validate_run",
    "launched_by_torchrun", "run_under_torchrun",
]

#: Seconds any collective (and the rendezvous) may wait before the run fails.
DEFAULT_TIMEOUT = 60.0
#: Test-only fault injection (``run_distributed(fault=...)``): what the faulty rank does.
FAULT_KINDS = ("raise", "exit_early", "skip_collective")


# --- the collectives ----------------------------------------------------------------------

#: Labels of the collectives one check issues (they name the collective in errors).
G_ALL_REDUCE = "g forward all-reduce of output partials"
F_ALL_REDUCE = "f backward all-reduce of dn"
GATHER_RESULTS = "all-gather of results to rank 0"


def planned_collectives(mode: str, cfg: Config | None = None) -> list[str]:
    """The collectives every rank issues, in order, in one check of ``mode``: g (unless the
    mode drops it), f (unless the mode drops it), then the gather of results to rank 0.
    A mode of the bug registry has its own plan (``tpattn.real.zoo_real.planned_collectives``).

    With fewer KV heads than ranks (``cfg``, see ``tpattn.parallel.kv_heads``) the KV collectives join
    in: ``replicate_weights`` all-reduces the wk/wv grads in the replica group in backward,
    before f (unless ``missing_kv_grad_reduce``); ``gather_activations`` all-gathers K/V in
    forward, before g, and reduce-scatters their gradient in backward, before f.
    """
    inj = resolve(mode, cfg).injection  # the mode's program, looked up once
    if inj is None or not inj.reduction_only or (cfg is not None and cfg.model_options):
        from .zoo_real import planned_collectives as registry_plan

        return registry_plan(mode, cfg)
    g = [G_ALL_REDUCE] if inj.g == 1 else []
    f = [F_ALL_REDUCE] if inj.f == "sum" else []
    if cfg is not None and has_replicas(cfg):
        if cfg.kv_strategy == GATHER_ACTIVATIONS:
            return [KV_ALL_GATHER] + g + [KV_REDUCE_SCATTER] + f + [GATHER_RESULTS]
        kv = [KV_GRAD_ALL_REDUCE] if inj.kv_grad == "sum" else []
        return g + kv + f + [GATHER_RESULTS]
    return g + f + [GATHER_RESULTS]


class CollectiveError(RuntimeError):
    """A collective failed (timed out, or a peer went away); says which one and where.

    ``deviation``: how this rank had strayed from the plan before it (``None`` if it had not);
    ``tpattn.real.launch`` uses it to blame the rank that skipped a collective.
    """

    in_collective = True

    def __init__(self, message: str, deviation: str | None = None):
        super().__init__(message)
        self.deviation = deviation


class CollectiveLedger:
    """Every collective one rank issues goes through here: counted, checked against the plan,
    and labelled for errors.

    ``counts``: the block's all-reduces by autograd phase (``"forward"``/``"backward"``);
    ``issued``: every collective so far (the gather of results included); ``history``: labels
    issued in the current job, which ``start_job`` names and gives its planned sequence;
    ``traffic``: the block's collectives in the current job, one row each (``label``, ``phase``,
    ``kind``, ``group_size``, ``elements``: see ``tpattn.parallel.kv_heads.kv_collectives``).
    ``replica_group``: this rank's KV replica group (a ``dist.new_group``), when there is one.
    ``entries``: the block's collectives in the current job in the simulated ledger's form
    (``tpattn.parallel.collectives``: ``{"collective", "phase", "group", "label", "op"}``,
    ``group`` ``"tp"`` or ``"kv_replicas"``, ``op`` the reduction the program asked for, ``None``
    for a gather: ``"avg"`` is issued as SUM then a division by the group size, gloo having no
    AVG, and recorded as ``"avg"``); what ``tpattn.diagnosis.observe`` reads.
    """

    def __init__(self, group=None):
        self.group = group
        self.replica_group = None
        self.counts = {"forward": 0, "backward": 0}
        self.issued = 0
        self.job, self.planned, self.history, self.traffic = "start-up", [], [], []
        self.entries = []

    def start_job(self, job: str, planned: list[str]) -> None:
        """Begin counting a new job (``job`` names it in errors; ``planned``: its collectives)."""
        self.job, self.planned, self.history, self.traffic = job, list(planned), [], []
        self.entries = []
        self.counts = {"forward": 0, "backward": 0}

    def deviation(self) -> str | None:
        """How this job's collectives so far stray from the plan, or ``None`` (a prefix of it)."""
        for index, issued in enumerate(self.history):
            planned = self.planned[index] if index < len(self.planned) else "nothing more"
            if issued != planned:
                return (f"it issued {issued} as collective #{index + 1} of {self.job} "
                        f"where the plan has {planned}")
        return None

    def finish_job(self) -> dict[str, int]:
        """Check the job issued exactly its plan; return its ``{"forward": n, "backward": m}``."""
        problem = self.deviation()
        if problem is None and len(self.history) != len(self.planned):
            problem = (f"it issued {len(self.history)} of the {len(self.planned)} planned "
                       f"collectives of {self.job}")
        if problem:
            raise RuntimeError("collectives out of plan: " + problem)
        return dict(self.counts)

    def _issue(self, label: str, collective, *args, group=None) -> None:
        self.issued += 1
        self.history.append(label)
        try:
            collective(*args, group=self.group if group is None else group)
        except Exception as e:  # name the collective; keep what the backend said
            raise CollectiveError(
                f"{label} (collective #{len(self.history)} of {self.job}) failed: {backend_message(e)}",
                self.deviation()) from e

    def _record(self, label, phase, kind, group, elements, op=None) -> None:
        size = dist.get_world_size(self.group if group is None else group)
        self.traffic.append({"label": label, "phase": phase, "kind": kind,
                             "group_size": size, "elements": elements})
        self.entry(kind, phase, "tp" if group is None or group is self.group else "kv_replicas",
                   label, op)

    def entry(self, kind: str, phase: str, group: str, label: str, op: str | None = None) -> None:
        """Append one collective to ``entries`` (the simulated ledger's form)."""
        self.entries.append({"collective": kind, "phase": phase, "group": group, "label": label,
                             "op": op})

    def all_reduce(self, tensor: torch.Tensor, phase: str, label: str, group=None,
                   op: str = "sum") -> None:
        """Sum ``tensor`` over the ranks (of ``group``, default: the ledger's), in place;
        counted under ``phase``. ``op="avg"``: then divided by the group size."""
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg' (got {op!r})")
        self.counts[phase] += 1
        self._record(label, phase, "all_reduce", group, tensor.numel(), op)
        self._issue(label, dist.all_reduce, tensor, group=group)
        if op == "avg":
            tensor /= dist.get_world_size(self.group if group is None else group)

    def all_gather_last_dim(self, local: torch.Tensor, phase: str, label: str) -> torch.Tensor:
        """Every rank's ``local`` ``[..., c]`` concatenated on the last dim, rank order:
        ``[..., W*c]`` (``dist.all_gather_single`` on the moved dim)."""
        part = local.movedim(-1, 0).contiguous()
        full = part.new_empty((dist.get_world_size(self.group) * part.shape[0], *part.shape[1:]))
        self._record(label, phase, "all_gather", None, full.numel())
        self._issue(label, dist.all_gather_single, full, part)
        return full.movedim(0, -1)

    def reduce_scatter_last_dim(self, full: torch.Tensor, phase: str, label: str) -> torch.Tensor:
        """The sum over ranks of ``full`` ``[..., W*c]``, this rank's chunk ``[..., c]`` of the
        last dim (``dist.reduce_scatter_single``): the backward of ``all_gather_last_dim``."""
        whole = full.movedim(-1, 0).contiguous()
        part = whole.new_empty((whole.shape[0] // dist.get_world_size(self.group), *whole.shape[1:]))
        self._record(label, phase, "reduce_scatter", None, whole.numel(), "sum")
        self._issue(label, dist.reduce_scatter_single, part, whole)
        return part.movedim(0, -1)

    # The block's collectives on this rank's own tensors: ``DistributedRanks`` calls these and
    # nothing else, so ``engine.rank_block`` runs with typed collectives
    # (``tpattn.diagnosis.typecheck``) in place of the ledger.

    def rank(self) -> int:
        """This rank's index in the ledger's group."""
        return dist.get_rank(self.group)

    def copy_to_ranks(self, n: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """f (``CopyToRanks``): ``n`` ``[S, B, hidden]`` unchanged; backward all-reduce
        (``op``: ``"sum"``, or ``"avg"``, the averaging bug)."""
        return CopyToRanks.apply(n, self, op)

    def reduce_output(self, partial: torch.Tensor) -> torch.Tensor:
        """g (``ReduceOutputPartials``): the sum over ranks of ``partial`` ``[S, B, hidden]``."""
        return ReduceOutputPartials.apply(partial, self)

    def reduce_replica_grads(self, wk: torch.Tensor, wv: torch.Tensor):
        """``tpattn.parallel.kv_heads.ReplicaGradReduce``: ``(wk, wv)`` unchanged; backward all-reduce
        of their gradients in the replica group."""
        return ReplicaGradReduce.apply(wk, wv, self)

    def gather_kv(self, local: torch.Tensor) -> torch.Tensor:
        """``tpattn.parallel.kv_heads.AllGatherKV``: ``[S, B, 2c]`` -> ``[S, B, W*2c]`` (rank order)."""
        return AllGatherKV.apply(local, self)

    def gather_tensors(self, tensors: dict[str, torch.Tensor],
                       label: str = GATHER_RESULTS) -> list[dict[str, torch.Tensor]]:
        """Every rank's ``tensors`` (same names and shapes on every rank), in one all-gather.

        Returns one dict per rank, in rank order.
        """
        flat = torch.cat([t.detach().reshape(-1) for t in tensors.values()])
        parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(self.group))]
        self._issue(label, dist.all_gather, parts, flat)
        sizes = [t.numel() for t in tensors.values()]
        return [{name: chunk.view_as(t) for (name, t), chunk in zip(tensors.items(), part.split(sizes))}
                for part in parts]


class CopyToRanks(torch.autograd.Function):
    """Megatron's **f** — forward: identity (every rank already holds the same ``n``);
    backward: all-reduce, so each rank's ``dn`` becomes the sum of every rank's contribution.

    n: ``[S, B, hidden]``; ``apply(n, ledger, op="sum")`` returns ``n`` (``op="avg"``: the
    backward averages, ``CollectiveLedger.all_reduce``).
    """

    @staticmethod
    def forward(ctx, n: torch.Tensor, ledger: CollectiveLedger, op: str = "sum") -> torch.Tensor:
        ctx.ledger, ctx.op = ledger, op
        return n.view_as(n)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.contiguous().clone()
        ctx.ledger.all_reduce(total, "backward", F_ALL_REDUCE, op=ctx.op)
        return total, None, None


class ReduceOutputPartials(torch.autograd.Function):
    """Megatron's **g** — forward: all-reduce, the output is the sum of the ranks' partials;
    backward: identity, every rank's partial receives the full output gradient.

    partial: ``[S, B, hidden]``; ``apply(partial, ledger)`` returns the sum ``[S, B, hidden]``.
    """

    @staticmethod
    def forward(ctx, partial: torch.Tensor, ledger: CollectiveLedger) -> torch.Tensor:
        total = partial.contiguous().clone()
        ledger.all_reduce(total, "forward", G_ALL_REDUCE)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class DistributedRanks:
    """``tpattn.parallel.collectives.SimulatedRanks``'s methods for one real rank: this process
    holds R = 1 local rank, so every tensor of ``engine.rank_block`` is ``[1, ...]``.

    ``ops`` issues the collectives on this rank's own tensors (``[...]``, no rank dim): a
    ``CollectiveLedger`` (``SequenceLedger`` under sequence parallelism) calls torch.distributed
    through ``CopyToRanks``, ``ReduceOutputPartials``, ``AllGatherKV``, ``ReplicaGradReduce``,
    ``GatherFromSequence`` and ``ReduceScatterToSequence`` and counts each one;
    ``tpattn.diagnosis.typecheck.TypedCollectives`` is spmd_types' typed twin. ``rank``: this
    rank (default ``ops.rank()``, asked only when the block needs it). The ledger's labels
    name the collectives; the labels the engine passes are the simulated ledger's and unused.
    """

    def __init__(self, cfg: Config, ops, rank: int | None = None):
        self.cfg, self.ops, self.ledger, self._rank = cfg, ops, ops, rank
        self.world_size = cfg.world_size

    @property
    def ranks(self) -> list[int]:
        """This process's global rank, the one entry of dim 0."""
        if self._rank is None:
            self._rank = self.ops.rank()
        return [self._rank]

    def record(self, phase: str, label: str, collective: str = "all_reduce",
               group: str = "tp") -> None:
        """Nothing: ``ops`` records each real collective when it is issued."""

    def copy_to_ranks(self, n: torch.Tensor, label: str = F_ALL_REDUCE,
                      op: str = "sum") -> torch.Tensor:
        """f on ``n`` ``[1, S, B, hidden]``: identity; backward all-reduce of dn (``op``:
        ``"sum"`` or ``"avg"``)."""
        return self.ops.copy_to_ranks(n[0], op).unsqueeze(0)

    def reduce_output(self, partial: torch.Tensor, label: str = G_ALL_REDUCE) -> torch.Tensor:
        """g on ``partial`` ``[1, S, B, hidden]``: all-reduce; backward identity."""
        return self.ops.reduce_output(partial[0]).unsqueeze(0)

    def own_tokens(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's ``S/W`` tokens of ``full`` ``[1, S, ...]``: ``[1, S/W, ...]``."""
        return full[:, rank_tokens(self.cfg, self.ranks[0])]

    def gather_sequence(self, n: torch.Tensor, reduce_grad: bool = True) -> torch.Tensor:
        """SP's f: ``[1, S/W, B, hidden]`` -> ``[1, S, B, hidden]`` (all-gather; backward
        reduce-scatter, or with ``reduce_grad=False`` this rank's tokens of its own dn)."""
        return self.ops.gather_sequence(n[0], reduce_grad).unsqueeze(0)

    def reduce_scatter_sequence(self, partial: torch.Tensor) -> torch.Tensor:
        """SP's g: ``[1, S, B, hidden]`` -> ``[1, S/W, B, hidden]`` (reduce-scatter; backward
        all-gather of dy)."""
        return self.ops.reduce_scatter_sequence(partial[0]).unsqueeze(0)

    def gather_kv(self, local: torch.Tensor) -> torch.Tensor:
        """K/V all-gather: ``[1, S, B, c]`` -> ``[1, S, B, W*c]`` (rank order on the last dim);
        backward reduce-scatter."""
        return self.ops.gather_kv(local[0]).unsqueeze(0)

    def reduce_replica_grads(self, wk: torch.Tensor, wv: torch.Tensor):
        """``(wk, wv)`` ``[1, rows, hidden]`` unchanged; backward all-reduce of their gradients
        in this rank's KV replica group."""
        return self.ops.reduce_replica_grads(wk, wv)

    def reduce_norm_grad(self, grad: torch.Tensor, how: str = "sum") -> torch.Tensor:
        """SP's ``norm`` gradient ``[1, hidden]`` after backward: all-reduced (``"sum"``),
        all-reduced and divided by W (``"mean"``) or kept (``"none"``)."""
        return self.ops.reduce_norm_grad(grad[0], how).unsqueeze(0)

    def reduce_qk_norm_grads(self, gq: torch.Tensor, gk: torch.Tensor):
        """The q/k-norm weights' gradients ``[1, head_dim]`` each after backward: one
        all-reduce (sum over the TP group) of the two, concatenated."""
        both = torch.cat([gq[0], gk[0]]).detach().clone()
        self.ops.counts.setdefault("after backward", 0)
        self.ops.all_reduce(both, "after backward", QK_NORM_GRAD_LABEL)
        d = gq.shape[1]
        return both[:d].unsqueeze(0), both[d:].unsqueeze(0)

    def reduce_scalar(self, value: torch.Tensor, label: str) -> torch.Tensor:
        """The sum over ranks of ``value`` ``[1]`` (a step-phase all-reduce): a scalar."""
        total = value.detach().reshape(1).clone()
        self.ops.counts.setdefault("step", 0)
        self.ops.all_reduce(total, "step", label)
        return total[0]


def real_rank_block(x: torch.Tensor, shard: dict[str, torch.Tensor], cfg: Config, inj, ops,
                    rank: int | None = None, rng=None) -> torch.Tensor:
    """This real rank's output of ``tpattn.parallel.engine.rank_block`` wired as ``inj`` says
    (``tpattn.parallel.injection.Injection``), its collectives issued by ``ops`` (see
    ``DistributedRanks``). x: ``[S_r, B, hidden]`` (S/W tokens under sequence parallelism);
    ``shard``: this rank's parameters; returns ``[S_r, B, hidden]`` (differentiable: gradients
    reach ``x`` and ``shard``). ``rng``: this rank's random streams
    (``tpattn.parallel.rng.process_streams``), needed when ``cfg.dropout > 0``."""
    p = {k: t.unsqueeze(0) for k, t in shard.items()}
    streams = {} if rng is None else {"rng": rng}  # without dropout: the five-argument call
    return rank_block(x.unsqueeze(0), p, cfg, inj, DistributedRanks(cfg, ops, rank),
                      **streams)[0]


# --- one check on every rank --------------------------------------------------------------

def gather_step(ledger: CollectiveLedger, rank: int, step: dict, unshard):
    """This rank's step gathered to rank 0 in one all-gather (``ledger.gather_tensors``).

    step: this rank's ``check.one_step``-style dict: ``output``, ``input_grad`` and its own
    ``grads``/``weights`` shards by name (other keys are kept). ``unshard(per_rank_dicts)``
    puts the ranks' shards together (e.g. ``params.unshard_params`` with its ``cfg``).
    Returns ``None`` on ranks other than 0; on rank 0 ``(ranks, full)``: every rank's gathered
    tensors in rank order (``output``, ``input_grad``, ``grad_<name>``, ``weight_<name>``) and
    ``step`` with full-size ``grads`` and ``weights``.
    """
    mine = {"output": step["output"], "input_grad": step["input_grad"],
            **{"grad_" + k: g for k, g in step["grads"].items()},
            **{"weight_" + k: w for k, w in step["weights"].items()}}
    ranks = ledger.gather_tensors(mine)
    if rank != 0:
        return None
    names = list(step["grads"])
    full = {kind: unshard([{k: r[prefix + k] for k in names} for r in ranks])
            for kind, prefix in (("grads", "grad_"), ("weights", "weight_"))}
    return ranks, {**step, **full}


#: Replicated tensors whose copies ``rank_check`` compares across ranks: name -> gathered key.
REPLICATED = {"output": "output", "input_grad": "input_grad", "norm_grad": "grad_norm",
              "norm_after_step": "weight_norm"}


def rank_disagreement(seed: int, mode: str, ranks: list[dict[str, torch.Tensor]],
                      replicated: dict[str, str] = REPLICATED) -> dict:
    """How far the other ranks' copies of replicated tensors are from rank 0's: ``seed``,
    ``mode`` and ``<name>_max_rank_diff`` (max abs difference over ranks) for every
    ``name -> gathered key`` of ``replicated``; ``ranks``: ``gather_step``'s list."""
    out = {"seed": seed, "mode": mode}
    for name, key in replicated.items():
        out[name + "_max_rank_diff"] = max(max_abs_diff(r[key], ranks[0][key]) for r in ranks)
    return out


def rank_check(seed: int, mode: str, cfg: Config, rank: int, ledger: CollectiveLedger,
               device: torch.device | str = "cpu", skip_output_reduce: bool = False):
    """One dense-vs-TP step, run on every rank of the group at once.

    Returns ``(metrics, disagreement)`` on rank 0 and ``(None, None)`` elsewhere. ``metrics`` is
    ``run(seed, mode, cfg)``'s dict; ``disagreement`` says how far the other ranks' own copies
    of the replicated tensors are from rank 0's: the output, dX, the ``norm`` gradient and the
    ``norm`` weight after the step (``<name>_max_rank_diff``, max abs difference).
    ``skip_output_reduce`` makes this one rank skip g's all-reduce (fault injection for tests).
    A mode of the bug registry runs in ``tpattn.real.zoo_real.zoo_rank_check``.
    Where KV heads are replicated, ``disagreement`` also says how far the copies of each KV
    head are apart (``kv_replica_grad_max_diff``, ``kv_replica_after_step_max_diff``: max over
    replica groups and wk/wv of the max abs difference from the group's first rank).
    """
    inj = resolve(mode, cfg).injection  # the mode's program, looked up once
    # the zoo's program (tpattn.real.zoo_real)
    if inj is None or not inj.reduction_only or (cfg is not None and cfg.model_options):
        from .zoo_real import zoo_rank_check

        return zoo_rank_check(seed, mode, cfg, rank, ledger, device)
    device = torch.device(device)
    x0, target = (t.to(device) for t in make_inputs(cfg, seed))
    base = {k: v.to(device) for k, v in init_params(cfg, seed + PARAM_SEED_OFFSET).items()}

    if skip_output_reduce:
        inj = replace(inj, g=0)

    def forward(x, shard):
        return real_rank_block(x, shard, cfg, inj, ledger, rank)

    # every rank its own step on its own shard and its own loss, as in real TP training
    step = one_step(forward, x0, target, shard_params(base, cfg)[rank])
    gathered = gather_step(ledger, rank, step, lambda per_rank: unshard_params(per_rank, cfg))
    if gathered is None:
        return None, None
    ranks, tp = gathered
    metrics = five_measures(seed, mode, dense_reference(x0, target, base, cfg), tp)
    disagreement = rank_disagreement(seed, mode, ranks)
    if kv_grad_bug_applies(cfg):
        for name, prefix in (("grad", "grad_"), ("after_step", "weight_")):
            disagreement[f"kv_replica_{name}_max_diff"] = max(
                max_abs_diff(ranks[r][prefix + w], ranks[group[0]][prefix + w])
                for group in replica_groups(cfg) for r in group for w in ("wk", "wv"))
    return metrics, disagreement


# --- every rank's work, and what rank 0 reports ------------------------------------------

@dataclass(frozen=True)
class RunPlan:
    """What every rank runs (picklable: spawned ranks receive it).

    ``jobs``: ``(mode, seed)`` pairs, mode-major like ``run_matrix``; ``dtensor_seeds``: seeds of
    the DTensor cross-check (equivalence); ``fault``: test-only fault injection, see
    ``run_distributed``.
    """

    cfg: Config
    jobs: tuple[tuple[str, int], ...]
    dtensor_seeds: tuple[int, ...] = ()
    timeout: float = DEFAULT_TIMEOUT
    fault: dict | None = None


#: All-reduces correct TP needs per block: g once in forward, f once in backward.
EXPECTED_ALL_REDUCES = {"forward": 1, "backward": 1}


def expected_all_reduces(cfg: Config) -> dict[str, int]:
    """``EXPECTED_ALL_REDUCES``, plus the backward replica-group reduce of wk/wv where KV heads
    are replicated (the all-gather strategy adds no all-reduce: its collectives are an
    all-gather and a reduce-scatter, see ``RealRankReport.traffic``)."""
    extra = 1 if kv_grad_bug_applies(cfg) else 0
    return {"forward": 1, "backward": 1 + extra}
#: DTensor's plan: RowwiseParallel(wo) sums once in forward; each of the three ColwiseParallel
#: layers (wq, wk, wv) reads the replicated input and sums its own share of dn in backward.
DTENSOR_EXPECTED_ALL_REDUCES = {"forward": 1, "backward": 3}


def _ledger_row(variant: str, mode: str, expected: dict, actual: dict) -> dict:
    return {"variant": variant, "mode": mode,
            "forward_expected": expected["forward"], "forward_actual": actual["forward"],
            "backward_expected": expected["backward"], "backward_actual": actual["backward"]}


def rank_ledger(cfg: Config, rank: int, timeout: float) -> CollectiveLedger:
    """This rank's ledger of real collectives, inside an initialized default process group: a
    ``CollectiveLedger`` (under sequence parallelism ``tpattn.real.sp_ranks.SequenceLedger``),
    with its KV replica group where KV heads are replicated (every rank creates every group,
    in the same order: ``new_group`` is collective)."""
    if cfg.sequence_parallel:
        from tpattn.real.sp_ranks import SequenceLedger

        ledger = SequenceLedger()
    else:
        ledger = CollectiveLedger()
    if kv_grad_bug_applies(cfg):
        for group in replica_groups(cfg):
            handle = dist.new_group(group, timeout=timedelta(seconds=timeout))
            if rank in group:
                ledger.replica_group = handle
    return ledger


def run_rank(rank: int, plan: RunPlan, device: torch.device | str = "cpu", on_progress=None) -> dict:
    """Every job of ``plan`` on this rank, inside an initialized default process group
    (``on_progress(index)`` is called after each job).

    Returns rank 0's report as a dict of lists (``results``, ``rank_disagreement``, ``ledger``,
    ``dtensor``; see ``RealRankReport``) plus ``issued`` and ``compute_s``; other ranks return
    only ``issued`` (their collective count) and ``compute_s``.
    """
    if plan.cfg.data_parallel > 1:  # a TP x DP mesh: tpattn.real.mesh_ranks
        from tpattn.real.mesh_ranks import mesh_run_rank

        return mesh_run_rank(rank, plan, device, on_progress)
    if plan.cfg.sequence_parallel:  # the sequence-parallel block: its own collectives
        from tpattn.real.sp_ranks import sp_run_rank

        return sp_run_rank(rank, plan, device, on_progress)
    start = time.monotonic()
    ledger = rank_ledger(plan.cfg, rank, plan.timeout)
    out = {"results": [], "rank_disagreement": [], "ledger": [], "dtensor": [], "traffic": []}
    counts_by_mode: dict[str, dict] = {}
    fault = plan.fault if plan.fault and plan.fault["rank"] == rank else None
    for index, (mode, seed) in enumerate(plan.jobs):
        ledger.start_job(f"seed {seed} {mode}", planned_collectives(mode, plan.cfg))
        faulty = fault is not None and index == 0
        if faulty and fault["kind"] == "raise":
            raise RuntimeError("fault injected for a test: this rank raises")
        if faulty and fault["kind"] == "exit_early":
            os._exit(0)  # silently, with a success code: the hardest death to notice
        metrics, disagreement = rank_check(
            seed, mode, plan.cfg, rank, ledger, device,
            skip_output_reduce=faulty and fault["kind"] == "skip_collective")
        counts = ledger.finish_job()
        if rank == 0:
            out["results"].append(metrics)
            out["rank_disagreement"].append(disagreement)
            if counts_by_mode.setdefault(mode, counts) != counts:
                raise RuntimeError(f"collective counts of {mode} differ between seeds")
            if mode not in {row["mode"] for row in out["traffic"]}:
                out["traffic"] += [{"mode": mode, **row} for row in ledger.traffic]
        if on_progress:
            on_progress(index)
    out["ledger"] = [_ledger_row("tpattn f/g", mode, expected_all_reduces(plan.cfg), counts)
                     for mode, counts in counts_by_mode.items()]
    if plan.dtensor_seeds:
        from .dtensor_check import dtensor_check  # loads torch.distributed.tensor only when used

        dtensor_counts = None
        for seed in plan.dtensor_seeds:
            ledger.start_job(f"seed {seed} DTensor", [])
            if has_replicas(plan.cfg):
                # ColwiseParallel splits wk/wv rows evenly: less than a KV head per rank. Every
                # rank fails at the same view, before any collective of the forward.
                try:
                    dtensor_check(seed, plan.cfg, device)
                except RuntimeError as e:
                    out["dtensor"].append({"seed": seed, "error": describe_error(e)})
                    continue
            metrics, counts = dtensor_check(seed, plan.cfg, device)
            out["dtensor"].append(metrics)
            dtensor_counts = dtensor_counts or counts
        if dtensor_counts is not None:
            out["ledger"].append(_ledger_row("DTensor parallelize_module", EQUIVALENCE,
                                             DTENSOR_EXPECTED_ALL_REDUCES, dtensor_counts))
    if rank != 0:
        out = {}
    out["issued"] = ledger.issued
    out["compute_s"] = time.monotonic() - start
    return out


@dataclass
class RealRankReport:
    """What a real-rank run found (rank 0's view).

    - ``results``: one ``run()`` dict per (mode, seed), mode-major — compare with ``run_matrix``;
    - ``rank_disagreement``: per (mode, seed), how far ranks 1.. are from rank 0 on their own
      copies of the output, of dX, of the ``norm`` gradient and of the ``norm`` weight after
      the step (``<name>_max_rank_diff``, max abs difference; 0: every rank holds the same bits);
    - ``ledger``: per mode, the block's all-reduces in forward and backward, expected vs actual
      (plus one DTensor row when the cross-check ran);
    - ``dtensor``: ``run()`` dicts of the same block parallelized by PyTorch's TP API (where
      ``kv_heads < world_size``, ``{"seed", "error"}``: the one line PyTorch's TP API fails with);
    - ``timings``: seconds — ``startup_s`` (processes up, group joined), ``compute_s`` (rank
      0's jobs), ``total_s``. Not deterministic: never print them in the book;
    - ``traffic``: rank 0's block collectives in the first job of each mode, one row each
      (``mode`` and ``tpattn.parallel.kv_heads.kv_collectives``' keys).

    Under ``Config.sequence_parallel`` (``tpattn.real.sp_ranks.sp_run_rank``) output and dX
    are sharded, so ``rank_disagreement`` compares the ``norm`` gradient and weight only (plus
    ``norm_grad_by_rank``), and ``ledger`` rows count collectives by kind and phase with
    ``bytes_per_rank``.
    """

    world_size: int
    backend: str
    results: list[dict]
    rank_disagreement: list[dict]
    ledger: list[dict]
    dtensor: list[dict]
    timings: dict = field(default_factory=dict, compare=False)
    traffic: list[dict] = field(default_factory=list)


def validate_run(world_size, seeds, modes, config, timeout, fault):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1 (got {world_size!r})")
    cfg = Config(world_size=world_size) if config is None else config
    if not isinstance(cfg, Config):
        raise ValueError(f"config must be a tpattn.Config (got {type(cfg).__name__})")
    if cfg.world_size != world_size:
        raise ValueError(f"world_size must equal config.world_size, the number of TP ranks "
                         f"(got world_size={world_size}, config.world_size={cfg.world_size})")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a finite number of seconds > 0 (got {timeout!r})")
    if isinstance(seeds, int) or isinstance(modes, str):
        raise ValueError("seeds and modes must be sequences (e.g. seeds=[11], modes=['equivalence'])")
    seeds = tuple(check_seed(s) for s in seeds)
    modes = tuple(modes)
    entries = [resolve(m, cfg) for m in modes]  # each mode checked, in order
    if any(e.injection is None or not e.injection.reduction_only for e in entries):
        from tpattn.bugs.zoo import check_needs

        for m in modes:
            check_needs(m, cfg)  # a mode this shape cannot run fails here, not in the ranks
    if fault is not None:
        if not isinstance(fault, dict) or set(fault) != {"rank", "kind"}:
            raise ValueError(f"fault must be a dict with keys 'rank' and 'kind' (got {fault!r})")
        if fault["kind"] not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(FAULT_KINDS)} "
                             f"(got {fault['kind']!r})")
        if isinstance(fault["rank"], bool) or fault["rank"] not in range(world_size):
            raise ValueError(f"fault rank must be an integer in [0, {world_size}) "
                             f"(got {fault['rank']!r})")
        if not modes or not seeds:
            raise ValueError("fault needs at least one seed and one mode to run")
        if cfg.sequence_parallel or cfg.data_parallel > 1:
            raise ValueError("fault injection is not supported with config.sequence_parallel "
                             "or config.data_parallel > 1")
    if cfg.data_parallel > 1:
        from .mesh_ranks import check_mesh_config

        check_mesh_config(cfg)
    return cfg, seeds, modes, float(timeout)


def run_distributed(world_size: int, seeds=SEEDS, modes=MODES, config: Config | None = None, *,
                    timeout: float = DEFAULT_TIMEOUT, dtensor=True, backend: str | None = None,
                    fault: dict | None = None, start_method: str = "forkserver") -> RealRankReport:
    """Start ``world_size`` rank processes, run every mode × seed (and the DTensor cross-check)
    inside ONE process group, and return rank 0's report.

    ``config`` defaults to ``Config(world_size=world_size)`` and must have that world size
    (the TP degree: with ``config.data_parallel > 1`` the run starts ``config.ranks``
    processes, a TP x DP mesh, ``tpattn.real.mesh_ranks``).
    ``dtensor``: ``True`` cross-checks every seed with PyTorch's TP API, ``False`` none, or a
    sequence of seeds. ``backend``: ``default_backend(world_size)`` unless given.
    ``start_method``: ``"forkserver"`` (one server process imports torch once and forks the
    ranks: a second run from the same Python process starts in a fraction of a second) or
    ``"spawn"``. From a script, call it under ``if __name__ == "__main__":`` (as any
    multiprocessing code); from a notebook, just call it.

    Fails fast (``tpattn.real.launch``): any collective waits at most ``timeout`` seconds; a rank
    that raises, exits or skips a collective ends the run with ``RankFailure`` (one line,
    naming the rank), and no rank process is left when this returns or raises.

    ``fault`` is a **test-only hook**: ``{"rank": r, "kind": k}`` makes rank ``r`` misbehave in
    its first job — ``"raise"`` an exception, ``"exit_early"`` (exit code 0, no report), or
    ``"skip_collective"`` (skip g's all-reduce while the other ranks do it).
    """
    cfg, seeds, modes, timeout = validate_run(world_size, seeds, modes, config, timeout, fault)
    dtensor_seeds = (seeds if dtensor else ()) if isinstance(dtensor, bool) \
        else tuple(check_seed(s) for s in dtensor)
    if cfg.data_parallel > 1:  # a TP x DP mesh: cfg.ranks processes, no TP-API cross-check
        dtensor_seeds = ()
    plan = RunPlan(cfg=cfg, jobs=tuple((m, s) for m in modes for s in seeds),
                   dtensor_seeds=dtensor_seeds, timeout=timeout,
                   fault=dict(fault) if fault else None)
    backend = backend or default_backend(cfg.ranks)
    programs = [resolve(m, cfg).injection for m in modes]
    preload = ("tpattn.real.ranks",) + (("tpattn.parallel.sequence_parallel",) if cfg.sequence_parallel else ()) \
        + ((("tpattn.real.dtensor_sp",) if cfg.sequence_parallel else ("tpattn.real.dtensor_check",))
           if dtensor_seeds else ()) \
        + (("tpattn.real.zoo_real",) if not all(inj is not None and inj.reduction_only
                                                for inj in programs) else ())
    if cfg.data_parallel > 1:
        preload = ("tpattn.real.ranks", "tpattn.real.mesh_ranks")
    results, timings = run_on_ranks(run_rank, cfg.ranks, plan, timeout=timeout, backend=backend,
                                    start_method=start_method, preload=preload)
    rank0 = results[0]
    return RealRankReport(
        world_size=world_size, backend=backend, results=rank0["results"],
        rank_disagreement=rank0["rank_disagreement"], ledger=rank0["ledger"],
        dtensor=rank0["dtensor"], timings={**timings, "compute_s": rank0["compute_s"]},
        traffic=rank0.get("traffic", []))


# --- the command line: torchrun, or self-spawned ----------------------------------------

def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def run_under_torchrun(plan: RunPlan, backend: str, rank_fn=run_rank) -> dict:
    """This process is one of torchrun's ranks: join its group, run the plan (``rank_fn(rank,
    plan, device)``, default ``run_rank``), leave."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]:  # --standalone / one host
        pin_gloo_to_loopback()
    torch.set_num_threads(1)
    device = rank_device(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=plan.timeout))
    try:
        return rank_fn(rank, plan, device)
    finally:
        dist.destroy_process_group()
