"""The simulated ranks as a LIST of ranks (one tensor per rank, a Python loop), as the package
computed them before ``tpattn.parallel``'s engine replaced them (b42a997): kept here, verbatim,
as the reference ``tests/parallel/test_engine.py`` checks the engine against. Not used by the package.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpattn.check.core import LR, ranks_step  # noqa: F401 (test_engine calls ref.ranks_step)
from tpattn.config import Config
from tpattn.block.dense import attend_and_project, project_qkv
from tpattn.parallel.kv_heads import GATHER_ACTIVATIONS, kv_head_of_rank, replica_groups
from tpattn.block.layers import apply_rope, attention, repeat_kv, rms_norm
from tpattn.block.params import clone_trainable
from tpattn.parallel.engine import REPLICATED
from tpattn.parallel.wrong import ScaleGrad
from tpattn.parallel.sequence_parallel import rank_tokens
from tpattn.bugs.zoo import Injection, clip_coef

NORM_GRAD_REDUCTIONS = ("sum", "mean", "none")


# --- gather_activations: the per-rank pieces (the engine's ``_kv`` on one rank) ---------------

def local_kv(n: torch.Tensor, shard: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's K and V slices side by side (what it all-gathers): n ``[S, B, hidden]``,
    ``shard["wk"]``, ``shard["wv"]`` ``[c, hidden]`` -> ``[S, B, 2c]``."""
    return torch.cat([F.linear(n, shard["wk"]), F.linear(n, shard["wv"])], dim=-1)


def attend_gathered(n: torch.Tensor, shard: dict[str, torch.Tensor], kv_all: torch.Tensor,
                    cfg: Config, rank: int) -> torch.Tensor:
    """One rank's partial ``[S, B, hidden]`` from the gathered K/V ``kv_all`` ``[S, B, W*2c]``
    (every rank's ``local_kv``, rank order): its KV head, RoPE, its query heads, its wo columns."""
    s, b, d, w = n.shape[0], n.shape[1], cfg.head_dim, cfg.world_size
    parts = kv_all.view(s, b, w, 2, -1)  # rank, (K | V), slice
    k_all = parts[:, :, :, 0].reshape(s, b, cfg.kv_heads, d)
    v_all = parts[:, :, :, 1].reshape(s, b, cfg.kv_heads, d)
    h = kv_head_of_rank(cfg, rank)
    q = apply_rope(F.linear(n, shard["wq"]).view(s, b, -1, d))
    k, v = apply_rope(k_all[:, :, h:h + 1]), v_all[:, :, h:h + 1]
    ctx = attention(q, repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2]))
    return F.linear(ctx.reshape(s, b, -1), shard["wo"])


def rank_attend_and_project(n: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config,
                            inj: Injection) -> torch.Tensor:
    """``dense.attend_and_project`` with the injection's ``repeat_kv``: ``"interleave"`` is
    ``layers.repeat_kv``; ``"tile"`` repeats the whole block of local KV heads (the zoo's
    per-rank block at b42a997)."""
    q, k, v = project_qkv(n, p["wq"], p["wk"], p["wv"], cfg.head_dim)
    groups = cfg.group_size
    if inj.kv == "tile":
        k, v = k.repeat(1, 1, groups, 1), v.repeat(1, 1, groups, 1)
    else:
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    ctx = attention(q, k, v)
    return F.linear(ctx.reshape(n.shape[0], n.shape[1], -1), p["wo"])


class AllReduceGrads(torch.autograd.Function):
    """f over simulated ranks — forward: identity on every rank's tensor; backward: every rank
    receives the sum of all ranks' gradients (rank order), as ``dist.all_reduce`` of dn gives.

    ``apply(*tensors)``: one tensor per rank, returns one per rank.
    """

    @staticmethod
    def forward(ctx, *tensors: torch.Tensor):
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        total = sum(grads[1:], grads[0])
        return tuple(total.clone() for _ in grads)


class AllReduce(torch.autograd.Function):
    """g over simulated ranks — forward: every rank receives the sum of all ranks' tensors
    (rank order), as ``dist.all_reduce`` of the output partials gives; backward: identity, each
    rank's partial receives its own output's gradient.

    ``apply(*tensors)``: one tensor per rank, returns one per rank.
    """

    @staticmethod
    def forward(ctx, *tensors: torch.Tensor):
        total = sum(tensors[1:], tensors[0])
        return tuple(total.clone() for _ in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return grads


def tp_forward_ranks(xs: list[torch.Tensor], shards: list[dict[str, torch.Tensor]], cfg: Config,
                     reduce_output: bool = True, reduce_input_grad: bool = True,
                     f=AllReduceGrads, g=AllReduce) -> list[torch.Tensor]:
    """Every simulated rank's own output of the block, as real ranks compute it.

    xs: one ``[S, B, hidden]`` per rank (each rank's own copy of the same input); ``shards``:
    each rank's own parameters (``norm`` replicated, head-group shards of wq/wk/wv/wo), leaf
    tensors of their own. Returns one ``[S, B, hidden]`` per rank.

    ``reduce_output=False`` drops g: rank r's output is ``x + P_r``, its own partial.
    ``reduce_input_grad=False`` drops f: rank r's dn stays its own contribution.
    ``f``, ``g``: the two collectives, ``torch.autograd.Function`` subclasses whose
    ``apply(*tensors)`` maps one tensor per rank to one per rank (default ``AllReduceGrads``
    and ``AllReduce``; ``tpattn.exercises`` passes the reader's own).
    """
    ns = [rms_norm(x, shard["norm"], cfg.eps) for x, shard in zip(xs, shards)]
    if reduce_input_grad:
        ns = f.apply(*ns)
    partials = [attend_and_project(n, shard, cfg) for n, shard in zip(ns, shards)]
    outs = g.apply(*partials) if reduce_output else partials
    return [x + out for x, out in zip(xs, outs)]


def ledger_recorders(ledger: list | None):
    """``(record, record_on_backward)`` for a collectives ledger (``None``: record nothing).

    ``record(phase, label, op="sum")`` appends ``{"collective": "all_reduce", "phase", "group":
    "tp", "label", "op"}`` now; ``record_on_backward(t, label)`` appends a ``"backward"`` entry when ``t``'s
    gradient is computed (a hook), i.e. when backward reaches that all-reduce.
    """
    def record(phase, label, op="sum"):
        if ledger is not None:
            ledger.append({"collective": "all_reduce", "phase": phase, "group": "tp",
                           "label": label, "op": op})

    def record_on_backward(t, label, op="sum"):
        if ledger is not None and t.requires_grad:
            t.register_hook(lambda g: record("backward", label, op))

    return record, record_on_backward


def forward_ranks(xs: list[torch.Tensor], shards: list[dict[str, torch.Tensor]], cfg: Config,
                  inj: Injection, ledger: list | None = None) -> list[torch.Tensor]:
    """Every simulated rank's own output, each rank with its own leaf tensors (as
    ``tp.tp_forward_ranks``, with the injection's knobs).

    ``ledger``: if a list, every collective is appended to it as
    ``{"collective", "phase", "group", "label", "op"}`` when it runs (backward ones during backward).
    Returns one ``[S, B, hidden]`` per rank.
    """
    record, record_on_backward = ledger_recorders(ledger)
    w = cfg.world_size
    ns = [rms_norm(x, s["norm"], cfg.eps) for x, s in zip(xs, shards)]
    if inj.f != "none":
        ns = list(AllReduceGrads.apply(*ns))
        record_on_backward(ns[0], "f: all-reduce of dn", "avg" if inj.f == "mean" else "sum")
        if inj.f == "twice":
            ns = list(AllReduceGrads.apply(*ns))
            record_on_backward(ns[0], "all-reduce of dn (again)")
        if inj.f == "mean":
            ns = [ScaleGrad.apply(n, 1.0 / w) for n in ns]
    partials = [rank_attend_and_project(n, s, cfg, inj) for n, s in zip(ns, shards)]
    if inj.bias == "every_rank":
        partials = [pt + s["bias"] for pt, s in zip(partials, shards)]
    outs = partials
    for i in range(inj.g):
        outs = list(AllReduce.apply(*outs))
        record("forward", "g: all-reduce of output partials" + (" (again)" if i else ""))
    if inj.bias == "after_g":
        outs = [o + s["bias"] for o, s in zip(outs, shards)]
    return [x + o for x, o in zip(xs, outs)]


def grad_norm(grads: list[dict[str, torch.Tensor]], inj: Injection) -> torch.Tensor:
    """The global gradient norm from every rank's gradients (one dict per rank), float64: a
    ``REPLICATED`` parameter on rank 0 only unless ``inj.norm == "per_rank"``."""
    total = 0.0
    for rank, g in enumerate(grads):
        for name, t in g.items():
            if name in REPLICATED and rank > 0 and inj.norm == "once":
                continue
            total = total + t.double().pow(2).sum()
    return torch.as_tensor(total).sqrt()


def ranks_train_step(shards: list[dict[str, torch.Tensor]], batches, cfg: Config,
                     inj: Injection) -> dict:
    """One step of every simulated rank: forward, its own MSE loss, backward, the gradient
    norm (all-reduced), clipping if on, SGD.

    shards: every rank's parameters (detached; copied here); batches: every rank's
    ``(x, target)``. Returns ``outputs``, ``losses``, ``input_grads`` (per rank), ``grads``
    and ``weights`` (per rank dicts), ``grad_norm`` (the logged norm) and ``ledger``.
    """
    ps = [clone_trainable(s) for s in shards]
    xs = [b[0].clone().requires_grad_(True) for b in batches]
    ledger: list = []
    ys = forward_ranks(xs, ps, cfg, inj, ledger)
    losses = [F.mse_loss(y, b[1]) for y, b in zip(ys, batches)]
    sum(losses[1:], losses[0]).backward()
    grads = [{k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in p.items()}
             for p in ps]
    norm = grad_norm(grads, inj)
    ledger.append({"collective": "all_reduce", "phase": "step", "group": "tp",
                   "label": "sum of squared gradient norms", "op": "sum"})
    coef = clip_coef(norm, inj)
    scales = inj.rank_lr_scale or (1.0,) * cfg.world_size
    with torch.no_grad():
        weights = [{k: p[k] - LR * scales[r] * coef * g[k] for k in p}
                   for r, (p, g) in enumerate(zip(ps, grads))]
    return {"outputs": [y.detach() for y in ys], "losses": [l.detach() for l in losses],
            "input_grads": [x.grad for x in xs], "grads": grads, "weights": weights,
            "grad_norm": float(norm), "ledger": ledger}


class AllGatherRanks(torch.autograd.Function):
    """All-gather over simulated ranks — forward: every rank receives all ranks' tensors
    concatenated on the last dim (rank order), as ``dist.all_gather`` gives; backward: a
    reduce-scatter, rank r receives the sum over ranks of the gradient of chunk r.

    ``apply(*tensors)``: one ``[S, B, c]`` per rank; returns one ``[S, B, W*c]`` per rank.
    """

    @staticmethod
    def forward(ctx, *tensors: torch.Tensor):
        ctx.width = tensors[0].shape[-1]
        full = torch.cat(tensors, dim=-1)
        return tuple(full.clone() for _ in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        total = sum(grads[1:], grads[0])
        return tuple(chunk.clone() for chunk in total.split(ctx.width, dim=-1))


def tp_forward_kv_ranks(xs: list[torch.Tensor], shards: list[dict[str, torch.Tensor]],
                        cfg: Config, reduce_output: bool = True, reduce_input_grad: bool = True,
                        reduce_kv_grad: bool = True) -> list[torch.Tensor]:
    """``tpattn.parallel.tp.tp_forward_ranks`` (every simulated rank its own leaves, output and loss)
    for ``kv_heads < world_size``.

    ``replicate_weights``: each replica is its own leaf; the replica-group reduce is
    ``AllReduceGrads`` over the group's wk (and wv) tensors — identity forward, sum of the
    group's gradients backward. ``reduce_kv_grad=False`` drops it: each copy keeps its own
    rank's gradient. ``gather_activations``: ``AllGatherRanks`` of every rank's ``local_kv``.
    xs, shards: one per rank; returns one ``[S, B, hidden]`` per rank.
    """
    ns = [rms_norm(x, s["norm"], cfg.eps) for x, s in zip(xs, shards)]
    if reduce_input_grad:
        ns = AllReduceGrads.apply(*ns)
    if cfg.kv_strategy == GATHER_ACTIVATIONS:
        fulls = AllGatherRanks.apply(*[local_kv(n, s) for n, s in zip(ns, shards)])
        partials = [attend_gathered(n, s, full, cfg, r)
                    for r, (n, s, full) in enumerate(zip(ns, shards, fulls))]
    else:
        shards = [dict(s) for s in shards]
        if reduce_kv_grad:
            for group in replica_groups(cfg):
                for name in ("wk", "wv"):
                    summed = AllReduceGrads.apply(*[shards[r][name] for r in group])
                    for r, t in zip(group, summed):
                        shards[r][name] = t
        partials = [attend_and_project(n, s, cfg) for n, s in zip(ns, shards)]
    outs = AllReduce.apply(*partials) if reduce_output else partials
    return [x + out for x, out in zip(xs, outs)]


class AllGatherSeq(torch.autograd.Function):
    """The all-gather along the sequence, over simulated ranks — forward: every rank receives
    the ranks' chunks concatenated in rank order; backward: a reduce-scatter — rank r receives
    its tokens of the sum of every rank's gradient (rank order).

    ``apply(reduce_grad, *chunks)``: one ``[S/W, ...]`` per rank, returns one ``[S, ...]`` per
    rank. ``reduce_grad=False`` (the ``missing_input_grad_reduce`` bug): rank r keeps its
    tokens of its *own* gradient only.
    """

    @staticmethod
    def forward(ctx, reduce_grad: bool, *chunks: torch.Tensor):
        ctx.reduce_grad = reduce_grad
        full = torch.cat(chunks, dim=0)
        return tuple(full.clone() for _ in chunks)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        w = len(grads)
        if ctx.reduce_grad:
            total = sum(grads[1:], grads[0])
            return (None, *(c.clone() for c in total.chunk(w, dim=0)))
        return (None, *(g.chunk(w, dim=0)[r].clone() for r, g in enumerate(grads)))


class ReduceScatterSeq(torch.autograd.Function):
    """The reduce-scatter along the sequence, over simulated ranks — forward: rank r receives
    its tokens of the sum of every rank's partial (rank order); backward: an all-gather —
    every rank's partial receives the whole sequence's output gradient.

    ``apply(*partials)``: one ``[S, ...]`` per rank, returns one ``[S/W, ...]`` per rank.
    """

    @staticmethod
    def forward(ctx, *partials: torch.Tensor):
        total = sum(partials[1:], partials[0])
        return tuple(c.clone() for c in total.chunk(len(partials), dim=0))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        full = torch.cat(grads, dim=0)
        return tuple(full.clone() for _ in grads)


def finalize_norm_grads(norm_grads: list[torch.Tensor], how: str = "sum") -> list[torch.Tensor]:
    """The all-reduce of the replicated ``norm`` weight's gradient after backward, over
    simulated ranks (Megatron's ``finalize_model_grads`` for ``sequence_parallel`` weights).

    norm_grads: one ``[hidden]`` per rank (its tokens' share). ``how``: ``"sum"`` — every rank
    gets the sum (rank order); ``"mean"`` — the sum divided by W (a bug); ``"none"`` — each
    rank keeps its own share (a bug). Returns one ``[hidden]`` per rank.
    """
    if how not in NORM_GRAD_REDUCTIONS:
        raise ValueError(f"how must be one of {', '.join(NORM_GRAD_REDUCTIONS)} (got {how!r})")
    if how == "none":
        return [g.clone() for g in norm_grads]
    total = sum(norm_grads[1:], norm_grads[0])
    if how == "mean":
        total = total / len(norm_grads)
    return [total.clone() for _ in norm_grads]


def sp_forward_ranks(xs: list[torch.Tensor], shards: list[dict[str, torch.Tensor]], cfg: Config,
                     reduce_output: bool = True, reduce_input_grad: bool = True) -> list[torch.Tensor]:
    """Every simulated rank's own output shard of the SP block.

    xs: one ``[S/W, B, hidden]`` per rank (its own tokens); ``shards``: each rank's own
    parameters (``norm`` replicated, head-group shards), leaf tensors of their own. Returns
    one ``[S/W, B, hidden]`` per rank.

    ``reduce_output=False`` drops the reduce-scatter: rank r keeps its tokens of its *own*
    partial. ``reduce_input_grad=False`` drops the all-gather's backward reduce-scatter.
    """
    ns = [rms_norm(x, shard["norm"], cfg.eps) for x, shard in zip(xs, shards)]  # local tokens
    gathered = AllGatherSeq.apply(reduce_input_grad, *ns)  # [S] on every rank
    partials = [attend_and_project(n, shard, cfg) for n, shard in zip(gathered, shards)]
    if reduce_output:
        outs = ReduceScatterSeq.apply(*partials)
    else:
        outs = [partial[rank_tokens(cfg, r)] for r, partial in enumerate(partials)]
    return [x + out for x, out in zip(xs, outs)]


def sp_ranks_step(xs0: list[torch.Tensor], targets: list[torch.Tensor],
                  shards: list[dict[str, torch.Tensor]], cfg: Config, reduce_output: bool = True,
                  reduce_input_grad: bool = True, norm_grad: str = "sum") -> list[dict]:
    """One training step on every simulated SP rank (``tpattn.check.core.ranks_step`` for SP).

    xs0, targets: rank r's tokens ``[S/W, B, hidden]``; ``shards``: each rank's starting
    parameters (copied). Rank r back-propagates its share of the global MSE, its ``norm``
    gradient is finalized with ``finalize_norm_grads(norm_grad)``, then it takes its own SGD
    step. Returns one dict per rank: ``output``, ``input_grad`` (its tokens), ``grads`` and
    ``weights`` (its shards); ``loss`` is the global MSE of every rank's output.
    """
    ps = [clone_trainable(shard) for shard in shards]
    xs = [x.clone().requires_grad_(True) for x in xs0]
    ys = sp_forward_ranks(xs, ps, cfg, reduce_output, reduce_input_grad)
    numel = sum(t.numel() for t in targets)
    shares = [F.mse_loss(y, t, reduction="sum") / numel for y, t in zip(ys, targets)]
    sum(shares[1:], shares[0]).backward()
    norm_grads = finalize_norm_grads([p["norm"].grad for p in ps], norm_grad)
    loss = F.mse_loss(torch.cat([y.detach() for y in ys]), torch.cat(targets))
    steps = []
    for x, p, y, norm_g in zip(xs, ps, ys, norm_grads):
        grads = {k: norm_g if k == "norm" else (t.grad if t.grad is not None else torch.zeros_like(t))
                 for k, t in p.items()}
        with torch.no_grad():
            weights = {k: p[k] - LR * grads[k] for k in p}
        steps.append({"output": y.detach(), "loss": loss, "input_grad": x.grad,
                      "grads": grads, "weights": weights})
    return steps
