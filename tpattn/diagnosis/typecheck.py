"""Tier 0: ``typecheck(mode, cfg)`` runs ``engine.rank_block`` for rank 0, forward and backward,
under ``spmd_types``' checker with its typed collectives (f ``convert(I->R)``, g
``all_reduce(P->I)``; ``I`` invariant, ``R`` replicate, ``V`` varying, ``P`` partial) on a
fake process group of ``cfg.world_size`` ranks: no data moves."""
from __future__ import annotations

import contextlib
from dataclasses import replace
import traceback
from types import SimpleNamespace
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import torch.nn.functional as F
from spmd_types import (I, P, R, S, V, SpmdTypeError, all_gather, all_reduce, assert_type,
                        convert, reduce_scatter, register_local_autograd_function,
                        reinterpret, set_current_mesh, traceback_filtering)
from spmd_types.checker import typecheck as spmd_typecheck

from tpattn.check.core import (EQUIVALENCE, MISSING_INPUT_GRAD_REDUCE, MISSING_KV_GRAD_REDUCE,
                               MISSING_OUTPUT_REDUCE, block_inputs, check_seed, make_params,
                               rank_batches, shard)
from tpattn.config import Config
from tpattn.bugs.modes import resolve
from tpattn.bugs.zoo import MESH_NEEDS, REGISTRY
from tpattn.parallel.kv_heads import has_replicas, kv_grad_bug_applies
from tpattn.parallel.engine import rank_block
from tpattn.parallel.program import Program
from tpattn.parallel.rng import simulated_streams
from tpattn.parallel.sequence_parallel import rank_tokens
from tpattn.parallel.wrong import ScaleGrad, no_collective

__all__ = ["TYPECHECK_VERDICTS", "WHY", "TypedCollectives", "fake_process_group", "typecheck",
           "TABLE_SETUPS", "typecheck_table"]

#: ``typecheck``'s verdicts: correct TP, a bug that raises ``SpmdTypeError``, a bug of a value
#: or layout (``WHY``), a dropped collective the local types do not see.
TYPECHECK_VERDICTS = ("type-checks", "caught", "not a type error", "missed")

#: Why the checker raises on each of these modes' bugs.
_CAUGHT = {
    MISSING_OUTPUT_REDUCE: "without g the varying partial meets invariant x at the residual add",
    MISSING_INPUT_GRAD_REDUCE: "without f the invariant norm output meets the varying wq in the "
                               "projection: an invariant's gradient would not be summed",
    "input_grad_reduced_twice": "the second f takes a tensor already R; convert wants I",
    "output_reduced_twice": "the second g takes a tensor already I; all_reduce wants P (or V)",
    "row_bias_on_every_rank": "the invariant bias meets the varying partial before g (the hint's "
                              "fix, convert(bias, I->R), would type-check and keep the W-fold "
                              "bias: the right fix is to add it after g)",
    "missing_norm_grad_reduce": "without the sum of its gradient the norm weight is I, and it "
                                "meets the varying tokens in RMSNorm",
    "qk_norm_grad_not_reduced": "without the sum of their gradients the q/k-norm weights are I, "
                                "and they meet the varying heads of this rank in their RMSNorm",
    MISSING_KV_GRAD_REDUCE: "without the replica-group reduce wk is I on the replica axis, and it "
                            "meets the R norm output in the K projection",
}
#: Why these modes' bugs are values or layouts no local type records.
_NOT_A_TYPE_ERROR = {
    "input_grad_reduce_averaged": "f is there (convert I->R); dividing its backward by W is a "
                                  "scale on a gradient, a value no type records",
    "grad_norm_counts_replicas": "the block is correct; the bug is in the gradient norm after "
                                 "backward, a sum over parameters that counts a replicated one "
                                 "W times: a count, not a type",
    "fused_qkv_naive_split": "every rank's rows of the fused weight are varying whichever rows "
                             "they are: which rows a rank holds is a layout, not a type",
    "qkv_loaded_from_rank0": "rank 0's rows on rank 1 are as varying as rank 1's own: which "
                             "rank's rows a loader narrowed is a value, not a type",
    "grouped_qkv_read_as_plain": "key rows read as query rows have the query rows' shape and "
                                 "type: the order of a rank's rows is a layout, not a type",
    "repeat_kv_tiled": "tiling instead of interleaving is a permutation of heads inside one "
                       "rank: same types, wrong pairing",
    "inputs_not_replicated": "x is declared invariant and the checker trusts declarations: "
                             "ranks holding different values under an I type is a value fact "
                             "one fake rank cannot see",
    "dropout_rng_desync": "the residual-dropout mask is declared invariant and the checker "
                          "trusts declarations: tp_rank 0 drawing another mask from a drifted "
                          "RNG is a value fact one fake rank cannot see",
    "norm_grad_averaged": "the norm weight's gradient is all-reduced (R); dividing by W is a "
                          "scale, a value no type records",
}
#: Per mode and verdict: why the type checker does or does not see it.
WHY = {EQUIVALENCE: {"type-checks": "f turns the invariant norm output into R (its gradient is "
                                    "summed), g turns the partials into I: every op sees types "
                                    "that mix"},
       **{mode: {"caught": why} for mode, why in _CAUGHT.items()},
       **{mode: {"not a type error": why} for mode, why in _NOT_A_TYPE_ERROR.items()}}
WHY[MISSING_OUTPUT_REDUCE]["missed"] = (
    "under sequence parallelism x is varying too (each rank its own tokens): a varying partial "
    "plus varying tokens type-checks; local types do not record that the partial is a pending sum")


class ContiguousGrad(torch.autograd.Function):
    """Identity forward; a contiguous gradient backward (spmd_types' all-reduce wants it)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class TypedCollectives:
    """Rank 0's process groups, the ``comm`` of ``engine.rank_block`` under ``typed_program``:
    ``axes`` the mesh's groups (TP, or ``("kv", "rep")``), ``tp`` the whole TP group,
    ``replica`` the replica axis or None."""

    def __init__(self, cfg: Config, mesh, axes, tp, replica=None):
        self.mesh, self.axes, self.tp, self.replica = mesh, tuple(axes), tp, replica
        self.cfg, self.world_size, self.ranks = cfg, cfg.world_size, [0]


def _in_dtype(t: torch.Tensor) -> dict:
    """A backward reduction in ``t``'s own dtype (spmd_types asks for it)."""
    return {"op_dtype": t.dtype}


def _rank0(op):
    """A typed stage: ``op(t, ops)`` on rank 0's ``[1, ...]`` tensor's one rank."""
    return lambda t, ops: op(t[0], ops).unsqueeze(0)


@_rank0
def _f(n: torch.Tensor, ops: TypedCollectives) -> torch.Tensor:
    """f: ``convert(I->R)`` on every axis."""
    for axis in ops.axes:
        n = convert(n, axis, src=I, dst=R, backward_options=_in_dtype(n))
    return n


@_rank0
def _g(partial: torch.Tensor, ops: TypedCollectives) -> torch.Tensor:
    """g: ``all_reduce(P->I)`` on every axis."""
    for axis in ops.axes:
        partial = all_reduce(partial, axis, src=P, dst=I)
    return partial


@_rank0
def _sp_gather(n: torch.Tensor, ops: TypedCollectives) -> torch.Tensor:
    """SP's all-gather ``S(0)->R``."""
    return all_gather(n, ops.tp, src=S(0), dst=R, backward_options=_in_dtype(n))


def _sp_own_tokens(full: torch.Tensor, ops: TypedCollectives) -> torch.Tensor:
    """No reduce-scatter: rank 0's tokens of its own partials."""
    return full[:, rank_tokens(ops.cfg, 0)]


def _replica_reduce(wk: torch.Tensor, wv: torch.Tensor, ops: TypedCollectives):
    """The replica-group reduce: ``convert(I->R)`` of wk and wv on the replica axis."""
    return tuple(ContiguousGrad.apply(convert(w, ops.replica, src=I, dst=R,
                                              backward_options=_in_dtype(w)))
                 for w in (wk, wv))


def typed_program(inj) -> Program:
    """``inj``'s program with its collective stages as spmd_types' typed collectives on rank
    0's ``[1, ...]`` tensors, wired as ``inj``'s knobs say (K/V all-gather ``S(-1)->R``:
    ``[S, B, 2c]`` -> ``[S, B, W*2c]``)."""
    def mean(stage):  # its gradient divided by W
        return lambda t, ops: stage(ScaleGrad.apply(t, 1.0 / ops.world_size), ops)
    stages = {"f": {"sum": _f, "none": no_collective, "mean": mean(_f),
                    "twice": lambda n, ops: _f(_f(n, ops), ops)}[inj.f],
              "g": {1: _g, 0: no_collective, 2: lambda p, ops: _g(_g(p, ops), ops)}[inj.g],
              "sp_gather": {"none": _rank0(lambda n, ops: all_gather(n, ops.tp, src=S(0), dst=I)),
                            "mean": mean(_sp_gather)}.get(inj.f, _sp_gather),
              "sp_scatter": (_rank0(lambda p, ops: reduce_scatter(p, ops.tp, src=P, dst=S(0)))
                             if inj.g else _sp_own_tokens),
              "kv_gather": _rank0(lambda local, ops: all_gather(
                  local, ops.tp, src=S(local.dim() - 1), dst=R,
                  backward_options=_in_dtype(local)))}
    if inj.kv_grad != "none":
        stages["replica_reduce"] = _replica_reduce
    return replace(inj.program(), **stages)


@contextlib.contextmanager
def fake_process_group(cfg: Config):
    """Yields the ``TypedCollectives`` of a fake process group of ``cfg.world_size`` ranks
    (this process rank 0; replicated KV weights: a 2-D mesh ``("kv", "rep")``)."""
    if dist.is_initialized():
        raise RuntimeError("typecheck needs its own fake process group, but one is already "
                           "initialized in this process (it was left alone)")
    dist.init_process_group(backend="fake", rank=0, world_size=cfg.world_size)
    try:
        if kv_grad_bug_applies(cfg):
            mesh = init_device_mesh("cpu", (cfg.kv_heads, cfg.kv_replicas),
                                    mesh_dim_names=("kv", "rep"))
            yield TypedCollectives(cfg, mesh, (mesh.get_group("kv"), mesh.get_group("rep")),
                                   dist.group.WORLD, mesh.get_group("rep"))
        else:
            mesh = init_device_mesh("cpu", (cfg.world_size,), mesh_dim_names=("tp",))
            yield TypedCollectives(cfg, mesh, (mesh.get_group("tp"),), mesh.get_group("tp"))
    finally:
        dist.destroy_process_group()


def _rank0_masks(cfg: Config, seed: int, inj) -> tuple[dict, dict]:
    """With dropout, rank 0's masks drawn before the checker runs: ``(streams for
    rank_block, {name: (mask, its type)})``; else empty."""
    if cfg.dropout <= 0:
        return {}, {}
    drawn = simulated_streams(cfg, seed, inj, tp_ranks=[0])
    masks = {"attention": (drawn.attention_masks(cfg), (V,)),  # its own heads'
             "residual": (drawn.residual_masks(cfg), (I,))}  # the same on every rank
    return {"rng": SimpleNamespace(attention_masks=lambda _: masks["attention"][0],
                                   residual_masks=lambda _: masks["residual"][0])}, masks


def _program(mode: str, cfg: Config, seed: int, ops: TypedCollectives, twin: bool = False):
    """A thunk that runs the mode's block (``twin``: its correct twin) on rank 0: forward, loss,
    backward. Its inputs are declared as correct TP types them: x I (SP: V); norm, bias I
    (SP: norm R, summed after backward); q/k-norm R; wq, wk, wv, wo V (replicated KV heads:
    wk, wv V on "kv", I on "rep")."""
    inj = resolve(mode, cfg).injection
    inj = inj.correct() if twin else inj
    shard0 = shard(make_params(cfg, seed, inj), cfg, inj)[0]
    params = {k: t.detach().clone().requires_grad_(True) for k, t in shard0.items()}
    x0, target = block_inputs(rank_batches(cfg, seed, inj), cfg)[0]
    x, target = x0.clone().requires_grad_(True), target.clone()
    summed = {"norm": cfg.sequence_parallel and inj.norm_grad != "none",
              "bias": False, "q_norm": inj.qk_norm_grad == "sum",
              "k_norm": inj.qk_norm_grad == "sum"}
    x_type = (V,) if cfg.sequence_parallel else (I,)
    streams, masks = _rank0_masks(cfg, seed, inj)
    types = {name: (R if summed[name] else I,) if name in summed else
             (V, I) if name in ("wk", "wv") and ops.replica is not None else (V,)
             for name in params}
    declared = {**{name: (t, types[name]) for name, t in params.items()},
                "x": (x, x_type), "target": (target, x_type),
                **{"mask_" + k: m for k, m in masks.items()}}
    prog = typed_program(inj)
    def forward(x):  # R = 1: the stacked views are made under the checker, typed
        stacked = {k: t.unsqueeze(0) for k, t in params.items()}
        return rank_block(x.unsqueeze(0), stacked, cfg, prog, ops, **streams)[0]
    numel = cfg.seq * cfg.batch * cfg.hidden
    def run():
        for t, typ in declared.values():  # (type on every axis, on the replica axis)
            assert_type(t, {axis: typ[-1] if axis is ops.replica else typ[0] for axis in ops.axes})
        if cfg.sequence_parallel:  # this rank's share of the global MSE: a pending sum
            share = F.mse_loss(forward(x), target, reduction="sum") / numel
            loss = reinterpret(share, ops.tp, src=V, dst=P)
        else:
            loss = F.mse_loss(forward(x), target)
        loss.backward()
    return run


def _where(error: BaseException) -> str:
    """``module.function: line`` of the two innermost tpattn frames of ``error`` outside
    this module, joined by ``" -> "``: the op that raised and the line that called it."""
    package = Path(__file__).resolve().parents[1]
    skipped = {Path(__file__).resolve()}
    found = []
    for frame in traceback.extract_tb(error.__traceback__):
        path = Path(frame.filename).resolve()
        if path not in skipped and package in path.parents:
            module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
            found.append(f"{module}.{frame.name}: {(frame.line or '').strip()}")
    return " -> ".join(found[-2:]) or "?"


def _validate(mode, cfg, seed):
    if not isinstance(cfg, Config):
        raise ValueError(f"cfg must be a tpattn.Config (got {type(cfg).__name__})")
    check_seed(seed)
    if not isinstance(mode, str):
        raise ValueError(f"mode must be a mode name (got {mode!r})")
    entry = resolve(mode, cfg)  # the original fixture's rules on cfg
    inj = entry.injection
    if cfg.data_parallel > 1 or set(entry.needs) & set(MESH_NEEDS):
        raise ValueError(f"typecheck checks one TP group (a fake process group of world_size "
                         f"ranks): data_parallel must be 1 and the mode's bug on the TP "
                         f"group (got data_parallel={cfg.data_parallel}; mode {mode!r} needs "
                         f"{', '.join(entry.needs) or 'nothing'})")
    if inj is None or not inj.reduction_only:
        resolve(mode, cfg, strict=True)  # ValueError naming the mode and what it needs (plain TP)
    return inj


def typecheck(mode: str, cfg: Config | None = None, seed: int = 11, *, twin: bool = False) -> dict:
    """``mode``'s per-rank block under ``spmd_types``' checker on a fake process group of
    ``cfg.world_size`` ranks: ``{"mode", "world_size", "sequence_parallel", "kv_layout", "verdict",
    "message", "where", "why"}`` (``message``: the ``SpmdTypeError``'s text, ``where``: the lines
    that raised, ``why``: ``WHY``'s; None when it type-checks). ``twin=True`` checks the mode's
    bug-free twin (``Injection.correct``) instead. ``ValueError`` for a mode ``cfg`` cannot run."""
    for function in (ScaleGrad, ContiguousGrad):  # identity forwards: types pass through
        register_local_autograd_function(function)
    cfg = Config() if cfg is None else cfg
    inj = _validate(mode, cfg, seed)
    message = where = None
    with fake_process_group(cfg) as ops:
        run = _program(mode, cfg, seed, ops, twin)
        try:
            with warnings.catch_warnings(), traceback_filtering("off"), \
                    set_current_mesh(ops.mesh), spmd_typecheck():
                # spmd_types 0.3.1's all_gather calls a functional collective torch 2.13
                # deprecates (a FutureWarning per call): not this check's concern
                warnings.filterwarnings("ignore", category=FutureWarning, module="spmd_types")
                run()
        except SpmdTypeError as e:
            message, where = str(e).strip(), _where(e)
    if message is not None:
        verdict = "caught"
    elif inj == inj.correct() or twin:  # correct TP (zoo.BugMode.is_correct)
        verdict = "type-checks"
    else:
        verdict = "not a type error" if "not a type error" in WHY.get(mode, {}) else "missed"
    layout = ("replicated KV heads, 2-D mesh (kv, rep)" if kv_grad_bug_applies(cfg)
              else "K/V all-gathered" if has_replicas(cfg) else "whole KV heads per rank")
    why = WHY[EQUIVALENCE]["type-checks"] if twin and message is None \
        else WHY.get(mode, {}).get(verdict, "no reason recorded for this verdict")
    return {"mode": mode, "world_size": cfg.world_size,
            "sequence_parallel": cfg.sequence_parallel, "kv_layout": layout,
            "verdict": verdict, "message": message, "where": where, "why": why}


#: The setup of each registry mode in ``typecheck_table`` (default ``Config()``).
TABLE_SETUPS = {
    "missing_norm_grad_reduce": Config(seq=8, sequence_parallel=True),
    "norm_grad_averaged": Config(seq=8, sequence_parallel=True),
    MISSING_KV_GRAD_REDUCE: Config(query_heads=8, kv_heads=2, world_size=4),
    "repeat_kv_tiled": Config(query_heads=8, kv_heads=4),
    "dropout_rng_desync": Config(dropout=0.1),
    "qk_norm_grad_not_reduced": Config(qk_norm=True),
    "grouped_qkv_read_as_plain": Config(query_heads=8, kv_heads=4),
}


def typecheck_table() -> list[dict]:
    """``typecheck`` of every registry mode at its ``TABLE_SETUPS`` setup, the TP x DP
    mesh's modes left out."""
    return [typecheck(name, TABLE_SETUPS.get(name, Config())) for name, m in REGISTRY.items()
            if not set(m.needs) & set(MESH_NEEDS)]
