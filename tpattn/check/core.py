"""The check: one dense step and one TP step from the same start, compared on five measures.

``check_injection(seed, mode, inj)`` checks the program ``inj`` (an ``Injection``; the bug
registry looks a mode's up, ``tpattn.run`` = ``tpattn.bugs.modes.run``) and returns the
original fixture's dict — same keys, same order, same floats::

    seed, mode,
    forward_max_abs_diff, loss_abs_diff, input_grad_max_abs_diff,
    parameter_grad_max_abs_diff, post_step_weight_max_abs_diff,
    passed            (every measure < TOLERANCE)
"""
from __future__ import annotations

import platform
from dataclasses import replace

import torch
import torch.nn.functional as F

from tpattn.config import Config
from tpattn.block.dense import dense_forward
from tpattn.block.fused_qkv import fuse_qkv_weight, load_qkv_weight, split_qkv_weight
from tpattn.block.kv_layout import has_replicas, replica_groups
from tpattn.block.params import (INIT_STD, PARAM_NAMES, QK_NORM_NAMES, clone_trainable,
                                 init_params, rank_head_slices, shard_params, unshard_params)
from tpattn.block.sgd import sgd_step
from .magnitude import gradient_magnitudes
from .measures import DIFF_CHUNK, MEASURES, TOLERANCE, five_measures, max_abs_diff
from .tolerance import (apply_auto, check_kernel_precision, check_tolerance, conditioning,
                        per_parameter, perturbed_start)
from tpattn.parallel.collectives import SimulatedRanks
from tpattn.parallel.engine import MAX_GRAD_NORM, grad_norm, stack_ranks
from tpattn.parallel.injection import Injection
from tpattn.parallel.one_graph import one_graph_forward
from tpattn.parallel.rng import replica_masks, simulated_streams, tile_masks
from tpattn.parallel.sequence_parallel import rank_tokens
from tpattn.parallel.simulated import mesh_view, rank0_view, simulated_step
from tpattn.parallel.tp import tp_forward

EQUIVALENCE = "equivalence"
MISSING_OUTPUT_REDUCE = "missing_output_reduce"
MISSING_INPUT_GRAD_REDUCE = "missing_input_grad_reduce"
#: The three TP variants, in the original fixture's order.
MODES = (EQUIVALENCE, MISSING_OUTPUT_REDUCE, MISSING_INPUT_GRAD_REDUCE)
MISSING_NORM_GRAD_REDUCE = "missing_norm_grad_reduce"
NORM_GRAD_AVERAGED = "norm_grad_averaged"
#: Variants that exist only under sequence parallelism (``Config.sequence_parallel``): the
#: ``norm`` weight's gradient all-reduce dropped, or averaged instead of summed.
SP_ONLY_MODES = (MISSING_NORM_GRAD_REDUCE, NORM_GRAD_AVERAGED)
#: Every variant valid under sequence parallelism (``--mode matrix`` runs them all).
SP_MODES = MODES + SP_ONLY_MODES
#: The replica-group reduce of wk/wv dropped (only where KV heads are replicated:
#: ``kv_heads < world_size`` with ``kv_strategy="replicate_weights"``; see ``tpattn.parallel.kv_heads``).
MISSING_KV_GRAD_REDUCE = "missing_kv_grad_reduce"
#: Every mode the original fixture's own check covers (``tpattn.bugs.modes.modes_for`` says
#: which apply to a Config); the bug registry (``tpattn.bugs.zoo.REGISTRY``) holds each one's ``Injection``.
ALL_MODES = MODES + SP_ONLY_MODES + (MISSING_KV_GRAD_REDUCE,)
#: The seeds of the original fixture's matrix.
SEEDS = (11, 17, 23, 29, 31)
#: Learning rate of the one SGD step.
LR = 0.05
#: ``init_params`` draws from ``seed + PARAM_SEED_OFFSET`` (inputs come from ``seed`` itself).
PARAM_SEED_OFFSET = 100
_SEED_MAX = 2**63 - 1 - PARAM_SEED_OFFSET
#: How ``run`` simulates the TP side. ``fixture``: the original fixture's model, one output
#: (rank 0's view: under a missing g only rank 0's partial exists and only its shard learns).
#: ``ranks``: every simulated rank computes its own output, loss and backward, as real ranks do.
SIMULATIONS = ("fixture", "ranks")


def check_seed(seed: int) -> int:
    """Return ``seed`` if it is an integer in ``[0, 2**63 - 101]``, else raise ``ValueError``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _SEED_MAX:
        raise ValueError(f"seed must be an integer in [0, {_SEED_MAX}] (got {seed!r})")
    return seed


def check_simulate(simulate: str) -> str:
    """Return ``simulate`` if it is one of ``SIMULATIONS``, else raise ``ValueError``."""
    if simulate not in SIMULATIONS:
        raise ValueError(f"simulate must be one of {', '.join(SIMULATIONS)} (got {simulate!r})")
    return simulate


def make_inputs(cfg: Config, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ``x`` and regression target, both ``[S, B * data_parallel, hidden]`` (the global
    batch; ``[S, B, hidden]`` without data parallelism), from the global RNG seeded with
    ``seed`` (drawn in float32, then cast to ``cfg.dtype``). DP replica d trains on batch
    columns ``d*B:(d+1)*B`` (``replica_batch``)."""
    torch.manual_seed(seed)
    x = torch.randn(cfg.seq, cfg.batch * cfg.data_parallel, cfg.hidden)
    target = torch.randn_like(x)
    return x.to(cfg.torch_dtype), target.to(cfg.torch_dtype)


def assert_close_within(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float,
                        atol: float, what: str = "values") -> None:
    """Raise ``AssertionError`` unless ``|actual - expected| <= atol + rtol * |expected|``
    holds for every element; the check of ``torch.testing.assert_close(actual, expected,
    rtol=rtol, atol=atol)`` without its import of ``torch.distributed.tensor`` (~1 s a kernel).

    actual, expected: tensors of one shape (any, e.g. ``[S, B, hidden]``) and one dtype,
    compared elementwise by ``torch.isclose`` in that dtype; NaN never matches. Both
    tolerances are required: each call states its bound. The message names ``what``, how many
    elements are off, the largest ``|actual - expected|`` among those, where, and the bound.
    A shape or dtype mismatch, a non-tensor or a negative or non-finite tolerance raises
    ``ValueError``.
    """
    for name, value in (("actual", actual), ("expected", expected)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor (got {type(value).__name__})")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite number >= 0 (got {value!r})")
    if actual.shape != expected.shape:
        raise ValueError(f"{what}: actual and expected must have one shape "
                         f"(got {list(actual.shape)} and {list(expected.shape)})")
    if actual.dtype != expected.dtype:
        raise ValueError(f"{what}: actual and expected must have one dtype "
                         f"(got {actual.dtype} and {expected.dtype})")
    actual, expected = actual.detach(), expected.detach()
    matches = torch.isclose(actual, expected, rtol=rtol, atol=atol)
    if bool(matches.all()):
        return
    diff = actual - expected if actual.is_complex() else actual.double() - expected.double()
    gap = diff.abs().double().nan_to_num(nan=float("inf")).where(~matches, -1.0)
    worst = int(gap.argmax())  # the worst of the elements that fail
    where, rest = [], worst
    for size in reversed(actual.shape):  # flat index -> [i, j, ...] (torch.unravel_index
        rest, i = divmod(rest, size)     # imports sympy)
        where.insert(0, i)
    off = int((~matches).sum())
    raise AssertionError(
        f"{what}: {off} of {matches.numel()} elements differ by more than "
        f"atol + rtol * |expected| (atol={atol:g}, rtol={rtol:g}); the largest of them, "
        f"|actual - expected| = {diff.abs().flatten()[worst].item():.3e} at index {where} "
        f"(actual {actual.flatten()[worst].item():.6g}, "
        f"expected {expected.flatten()[worst].item():.6g})")


def one_step(forward, x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor]) -> dict:
    """One training step of the fixture: ``forward(x, params) -> y``, MSE loss, backward, SGD.

    x0, target: ``[S, B, hidden]``; ``base``: the starting parameters (copied, not touched).
    Returns the tensors the five measures compare: ``output`` ``[S, B, hidden]``, ``loss``,
    ``input_grad`` ``[S, B, hidden]``, ``grads`` and ``weights`` (after the step, by name:
    ``sgd.sgd_step``'s, so float32 master weights for bfloat16 parameters).
    """
    p = clone_trainable(base)
    x = x0.clone().requires_grad_(True)
    y = forward(x, p)
    loss = F.mse_loss(y, target)
    loss.backward()
    weights = sgd_step(p, {k: t.grad for k, t in p.items()}, LR)
    return {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad,
            "grads": {k: p[k].grad for k in p}, "weights": weights}


def ranks_step(forward_ranks, x0: torch.Tensor, target: torch.Tensor,
               shards: list[dict[str, torch.Tensor]]) -> list[dict]:
    """``one_step`` on every simulated rank at once, each rank with its own leaf tensors.

    ``forward_ranks(xs, ps) -> ys`` maps every rank's input copy and parameters to every rank's
    output (e.g. ``tpattn.parallel.simulated.forward_rank_list``). Each rank's MSE loss is its
    own; one backward of their sum gives each rank the gradient of its own loss (the ranks'
    graphs meet only in the collectives), then each rank takes its own SGD step. Returns one ``one_step`` dict per rank
    (``grads``/``weights`` hold that rank's shards).
    """
    ps = [clone_trainable(shard) for shard in shards]
    xs = [x0.clone().requires_grad_(True) for _ in shards]
    ys = forward_ranks(xs, ps)
    losses = [F.mse_loss(y, target) for y in ys]
    sum(losses[1:], losses[0]).backward()
    steps = []
    for x, p, y, loss in zip(xs, ps, ys, losses):
        grads = {k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in p.items()}
        weights = sgd_step(p, grads, LR)
        steps.append({"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad,
                      "grads": grads, "weights": weights})
    return steps


def dense_reference(x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor],
                    cfg: Config, masks: dict[str, torch.Tensor] | None = None) -> dict:
    """``one_step`` of the dense block: the side every TP variant is compared against
    (``masks``: the dropout masks of ``dense_forward``, with ``cfg.dropout > 0``)."""
    return one_step(lambda x, p: dense_forward(x, p, cfg, masks), x0, target, base)


# --- an injection's program: its parameters, its ranks' inputs, its cut --------------------

#: The optional output-projection bias is drawn from its own generator, ``seed + this``, so the
#: seed's parameters and their init order never change.
BIAS_SEED_OFFSET = 200
#: Under ``inputs="per_rank"`` rank ``r >= 1`` draws its batch from ``seed + this * r``.
OTHER_BATCH_SEED_OFFSET = 7919
#: With ``Config.qk_norm`` the q/k-norm weights are drawn from their own generator,
#: ``seed + this``, so the original fixture's parameters are the same numbers with or without them.
QK_NORM_SEED_OFFSET = 300


def dropout_masks(cfg: Config, seed: int) -> dict[str, torch.Tensor] | None:
    """The dropout masks the correct program draws in seed ``seed``'s step
    (``rng.replica_masks``: one DP replica, assembled over the TP ranks; on a TP x DP mesh
    tiled along the global batch, ``rng.tile_masks``), or ``None`` when
    ``cfg.dropout == 0``: what the dense reference applies."""
    if cfg.dropout == 0:
        return None
    return tile_masks(replica_masks(cfg, seed), cfg.data_parallel)


def make_params(cfg: Config, seed: int, inj: Injection, init: str = "seed") -> dict[str, torch.Tensor]:
    """``init_params(cfg, seed + PARAM_SEED_OFFSET, init)`` plus, when the setup has one, the
    output bias ``[hidden]`` from its own generator (``seed + BIAS_SEED_OFFSET``): the original fixture's
    parameters are the same numbers with or without it. With ``cfg.qk_norm``, ``q_norm`` and
    ``k_norm`` ``[head_dim]`` = ``1 + INIT_STD * randn`` from ``seed + QK_NORM_SEED_OFFSET``
    (not ones, so a gradient that misses heads changes the numbers)."""
    base = init_params(cfg, seed + PARAM_SEED_OFFSET, init)
    if inj.bias is not None:
        g = torch.Generator().manual_seed(seed + BIAS_SEED_OFFSET)
        base["bias"] = (torch.randn(cfg.hidden, generator=g) * INIT_STD).to(cfg.torch_dtype)
    if cfg.qk_norm:
        g = torch.Generator().manual_seed(seed + QK_NORM_SEED_OFFSET)
        for name in QK_NORM_NAMES:
            w = 1.0 + torch.randn(cfg.head_dim, generator=g) * INIT_STD
            base[name] = w.to(cfg.torch_dtype)
    return base


def fused_rows(cfg: Config, rank: int) -> slice:
    """The rows of the fused ``[Wq; Wk; Wv]`` ``[(Hq + 2*Hkv)*D, hidden]`` that rank ``rank``
    takes when it is cut into ``cfg.world_size`` contiguous slices (``shard="fused_naive"``)."""
    rows = (cfg.query_heads + 2 * cfg.kv_heads) * cfg.head_dim // cfg.world_size
    return slice(rank * rows, (rank + 1) * rows)


#: The ``Injection.shard`` values that load from a fused checkpoint through
#: ``fused_qkv.load_qkv_weight``: (the checkpoint's layout, how a rank reads its rows,
#: whether the caller passes ``tp_rank``).
LOADERS = {"fused_rank0": ("plain", "plain", False), "grouped": ("grouped", "grouped", True),
           "grouped_as_plain": ("grouped", "plain", True)}


def load_rank_shard(p: dict[str, torch.Tensor], cfg: Config, inj: Injection,
                    rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` loads from the checkpoint ``p`` (dense tensors) with the injection's
    loader (``LOADERS``): the fused ``wq``/``wk``/``wv`` checkpoint in its layout
    (``fuse_qkv_weight``), narrowed by ``load_qkv_weight`` (with ``tp_rank=rank``, or, under
    ``"fused_rank0"``, without it: rank 0's rows); ``wo`` the columns of the rank's query
    heads, ``norm`` (and ``bias``) replicated. Differentiable slices of ``p``. Any other
    ``shard``: ``shard(p, cfg, inj)[rank]``."""
    if inj.shard not in LOADERS or inj.shard_offset:
        return shard(p, cfg, inj)[rank]
    layout, read_as, passes_rank = LOADERS[inj.shard]
    checkpoint = fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, layout)
    kwargs = {"tp_rank": rank} if passes_rank else {}
    wq, wk, wv = load_qkv_weight(checkpoint, cfg, layout, read_as, **kwargs)
    q_cols, _ = rank_head_slices(cfg, rank)
    mine = {"norm": p["norm"], "wq": wq, "wk": wk, "wv": wv, "wo": p["wo"][:, q_cols]}
    if "bias" in p:
        mine["bias"] = p["bias"]
    return mine


def shard(p: dict[str, torch.Tensor], cfg: Config, inj: Injection) -> list[dict[str, torch.Tensor]]:
    """Every rank's parameters, as the injection's loader cuts them (differentiable views or
    slices of ``p``, so gradients flow back to ``p``).

    ``"heads"``/``"fused"``: ``shard_params`` (a fused checkpoint split by heads is the same
    numbers). ``"fused_naive"``: rank r takes contiguous rows of ``[Wq; Wk; Wv]`` and reads the
    first ``Hq/W * D`` as its query rows, the next ``Hkv/W * D`` as keys, the rest as values.
    ``LOADERS`` (``"fused_rank0"``, ``"grouped"``, ``"grouped_as_plain"``): every rank's
    ``load_rank_shard``. Replicated tensors (``norm``, ``bias``) are shared.
    ``shard_offset`` k: rank r gets rank ``(r + k) mod W``'s shards.
    """
    if inj.shard in LOADERS:
        base = replace(inj, shard_offset=0)
        shards = [{k: t for k, t in load_rank_shard(p, cfg, base, r).items() if k != "bias"}
                  for r in range(cfg.world_size)]
    elif inj.shard != "fused_naive":
        shards = shard_params({k: p[k] for k in PARAM_NAMES}, cfg)
    else:
        fused = torch.cat([p["wq"], p["wk"], p["wv"]])
        q, kv = cfg.local_query_heads * cfg.head_dim, cfg.local_kv_heads * cfg.head_dim
        shards = []
        for rank in range(cfg.world_size):
            rows = fused[fused_rows(cfg, rank)]
            q_cols, _ = rank_head_slices(cfg, rank)
            shards.append({"norm": p["norm"], "wq": rows[:q], "wk": rows[q:q + kv],
                           "wv": rows[q + kv:], "wo": p["wo"][:, q_cols]})
    if inj.shard_offset:  # rank r loads rank (r + k) mod W's shards
        k = inj.shard_offset % cfg.world_size
        shards = shards[k:] + shards[:k]
    for name in ("bias",) + QK_NORM_NAMES:  # replicated on every rank
        if name in p:
            for s in shards:
                s[name] = p[name]
    return shards


def unshard(shards: list[dict[str, torch.Tensor]], cfg: Config, inj: Injection) -> dict[str, torch.Tensor]:
    """The inverse of ``shard``: full-size tensors from every rank's own tensors (replicated
    ones from rank 0). ``"grouped"`` holds the numbers of ``"heads"``; ``"grouped_as_plain"``
    puts each rank's ``[wq; wk; wv]`` back on the grouped rows it read them from;
    ``"fused_rank0"`` (not invertible: ranks >= 1 never read their rows) puts rank r's
    tensors on rank r's heads, as saving the sharded model does."""
    if inj.shard_offset:
        k = inj.shard_offset % cfg.world_size
        shards = shards[len(shards) - k:] + shards[:len(shards) - k]
    if inj.shard == "grouped_as_plain":
        rows = torch.cat([torch.cat([s["wq"], s["wk"], s["wv"]]) for s in shards]).detach()
        wq, wk, wv = split_qkv_weight(rows, cfg, "grouped")
        full = {"norm": shards[0]["norm"].detach().clone(), "wq": wq.clone(),
                "wk": wk.clone(), "wv": wv.clone(),
                "wo": torch.cat([s["wo"] for s in shards], dim=1).detach().clone()}
    elif inj.shard != "fused_naive":
        full = unshard_params([{k: s[k] for k in PARAM_NAMES} for s in shards], cfg)
    else:
        fused = torch.cat([torch.cat([s["wq"], s["wk"], s["wv"]]) for s in shards]).detach()
        q, kv = cfg.query_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        full = {"norm": shards[0]["norm"].detach().clone(), "wq": fused[:q].clone(),
                "wk": fused[q:q + kv].clone(), "wv": fused[q + kv:].clone(),
                "wo": torch.cat([s["wo"] for s in shards], dim=1).detach().clone()}
        full = {k: full[k] for k in PARAM_NAMES}
    for name in ("bias",) + QK_NORM_NAMES:  # replicated: rank 0's copy
        if name in shards[0]:
            full[name] = shards[0][name].detach().clone()
    return full


def rank_batches(cfg: Config, seed: int, inj: Injection) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's ``(x, target)`` as it loads them, ``[S, B, hidden]`` each: the original fixture's
    batch on every rank, or under ``inputs="per_rank"`` rank ``r >= 1``'s own from
    ``seed + OTHER_BATCH_SEED_OFFSET * r`` (``block_inputs``: the part the block takes).
    On a TP x DP mesh every rank of the job, mesh order: replica d's batch columns
    (``replica_batch``) of what its TP rank draws."""
    first = make_inputs(cfg, seed)
    per_tp = [first] * cfg.world_size if inj.inputs != "per_rank" else [first] + [
        make_inputs(cfg, seed + OTHER_BATCH_SEED_OFFSET * r) for r in range(1, cfg.world_size)]
    if cfg.data_parallel == 1:
        return per_tp
    # a TP x DP mesh: every rank of replica d its batch columns of its TP rank's draw
    return [replica_batch(per_tp[t], cfg, d) for d in range(cfg.data_parallel)
            for t in range(cfg.world_size)]


def replica_batch(batch: tuple[torch.Tensor, torch.Tensor], cfg: Config,
                  d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DP replica ``d``'s ``(x, target)`` ``[S, B, hidden]``: batch columns ``d*B:(d+1)*B`` of
    the global ``batch`` (``make_inputs``)."""
    cols = slice(d * cfg.batch, (d + 1) * cfg.batch)
    return batch[0][:, cols], batch[1][:, cols]


def block_inputs(batches: list[tuple[torch.Tensor, torch.Tensor]],
                 cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The part of every rank's loaded ``(x, target)`` ``[S, B, hidden]`` that enters its
    block: under ``cfg.sequence_parallel`` rank r's own tokens ``[S/W, B, hidden]``
    (``sequence_parallel.rank_tokens``: the scatter along the sequence), else the batch."""
    if not cfg.sequence_parallel:
        return list(batches)
    return [(x[rank_tokens(cfg, i % cfg.world_size)], t[rank_tokens(cfg, i % cfg.world_size)])
            for i, (x, t) in enumerate(batches)]


def clip_coef(norm: torch.Tensor, inj: Injection) -> float:
    """The factor clipping puts on every gradient: ``min(1, MAX_GRAD_NORM / (norm + 1e-6))``
    under ``inj.clip``, else 1."""
    return min(1.0, MAX_GRAD_NORM / (float(norm) + 1e-6)) if inj.clip else 1.0


def dense_step(x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor],
               cfg: Config, inj: Injection,
               masks: dict[str, torch.Tensor] | None = None) -> dict:
    """The dense reference of the injection's setup (bias, clipping), in ``one_step``'s dict:
    ``dense_reference`` itself when the setup has neither. ``masks``: the dropout masks the
    correct program draws (``dropout_masks``), with ``cfg.dropout > 0``."""
    if "bias" not in base and not inj.clip:
        return dense_reference(x0, target, base, cfg, masks)
    p = clone_trainable(base)
    x = x0.clone().requires_grad_(True)
    y = dense_forward(x, p, cfg, masks) + (p["bias"] if "bias" in p else 0)
    loss = F.mse_loss(y, target)
    loss.backward()
    norm = torch.sqrt(sum(t.grad.double().pow(2).sum() for t in p.values()))
    coef = clip_coef(norm, inj)
    weights = sgd_step(p, {k: t.grad for k, t in p.items()}, LR, float(coef))
    return {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad,
            "grads": {k: t.grad for k, t in p.items()}, "weights": weights}


def fixture_step(x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor],
                 cfg: Config, inj: Injection, shard_fn, others=None) -> dict:
    """``one_step`` of the engine's block on ``one_graph.OneGraphRanks`` (rank 0's view, the
    ranks' shards ``shard_fn(p, cfg)``, views of ``p``), with the injection's gradient norm
    (``engine.grad_norm`` of the ranks' shards) and clipping. ``others``: ranks >= 1's own
    inputs ``[S, B, hidden]`` (constants; ``inputs="per_rank"``)."""
    p = clone_trainable(base)
    x = x0.clone().requires_grad_(True)
    y = one_graph_forward(x, p, cfg, inj, shard_fn, others)
    loss = F.mse_loss(y, target)
    loss.backward()
    grads = {k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in p.items()}
    per_rank = shard(grads, cfg, replace(inj, shard="heads" if inj.shard in
                                         ("fused_naive", *LOADERS) else inj.shard))
    norm = grad_norm(stack_ranks(per_rank), SimulatedRanks(cfg), inj)
    weights = sgd_step(p, grads, LR, float(clip_coef(norm, inj)))
    return {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad,
            "grads": grads, "weights": weights}


def cuts_by_heads(inj: Injection) -> bool:
    """True when the injection's loader hands rank r its own heads' rows (``shard_params``'s
    cut): the one graph then views the dense tensors rank-major (``one_graph.stacked_views``)."""
    return inj.shard in ("heads", "fused") and not inj.shard_offset


def original_program(inj: Injection, cfg: Config) -> bool:
    """The original fixture's three programs (f summed or dropped, g once or dropped) on plain
    TP: ``tp_step`` runs them through ``tp.tp_forward``, which normalizes ``x`` once and so
    keeps the original fixture's digits bit for bit."""
    return inj.f in ("sum", "none") and inj.g in (0, 1) and not cfg.sequence_parallel \
        and replace(inj, f="sum", g=1, norm_grad="sum", kv_grad="sum") == Injection() \
        and not has_replicas(cfg)


def _ranks_view(base, cfg: Config, inj: Injection, cut, gather, batches, rng_seed) -> dict:
    """The simulated ranks' step (``simulated_step``) of every rank of the job, reported as
    rank 0 sees it (``rank0_view``; on a TP x DP mesh ``mesh_view``)."""
    rng = simulated_streams(cfg, rng_seed, inj) if cfg.dropout > 0 else None
    step = simulated_step(cut(base, cfg) * cfg.data_parallel, block_inputs(batches, cfg), cfg,
                          inj, LR, rng=rng)
    return (mesh_view if cfg.data_parallel > 1 else rank0_view)(step, cfg, gather)


def tp_step(x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor], cfg: Config,
            inj: Injection, simulate: str = "fixture", shard_fn=None, batches=None,
            rng_seed: int | None = None) -> dict:
    """The TP side of the check: one step of the block wired as ``inj``, in ``one_step``'s
    dict (rank 0's view). x0, target: ``[S, B * data_parallel, hidden]``; ``base``:
    ``make_params``'s; ``shard_fn``: the cut (default ``shard(., ., inj)``); ``batches``:
    every rank's ``(x, target)``, mesh order (default ``replica_batch``); ``rng_seed``: the
    run's seed (dropout). ``"ranks"``, a mesh, a model option or an aliasing loader run the
    simulated ranks; else one graph (``fixture_step``; ``original_program``: ``tp_forward``).
    """
    if not isinstance(inj, Injection):
        raise ValueError(f"inj must be an Injection, the mode's program "
                         f"(tpattn.bugs.modes.resolve(mode).injection) (got {inj!r})")
    if cfg.dropout > 0 and rng_seed is None:
        raise ValueError("rng_seed must be the run's seed when dropout > 0: the ranks' "
                         "random streams are seeded with it")
    if batches is None:
        batches = [replica_batch((x0, target), cfg, d) for d in range(cfg.data_parallel)
                   for _ in range(cfg.world_size)]
    cut = shard_fn or (lambda q, c: shard(q, c, inj))
    aliased = inj.shard in LOADERS and not LOADERS[inj.shard][2] and shard_fn is None
    if check_simulate(simulate) == "ranks" or cfg.data_parallel > 1 or cfg.model_options \
            or aliased:  # one graph would share rows that the ranks' loaders alias
        gather = None if shard_fn else (lambda per_rank: unshard(per_rank, cfg, inj))
        return _ranks_view(base, cfg, inj, cut, gather, batches, rng_seed)
    if original_program(inj, cfg):
        return one_step(lambda x, p: tp_forward(x, p, cfg, reduce_output=inj.g == 1,
                                                reduce_input_grad=inj.f == "sum",
                                                shard_fn=shard_fn or shard_params),
                        x0, target, base)
    others = [b[0] for b in batches[1:]] if inj.inputs == "per_rank" else None
    views = shard_fn is None and cuts_by_heads(inj) and not has_replicas(cfg)
    return fixture_step(x0, target, base, cfg, inj, shard_params if views else cut, others)


def check_injection(seed: int, mode: str, inj: Injection, cfg: Config | None = None,
                    simulate: str = "fixture", shard_fn=None, tolerance: str = "seed",
                    init: str = "seed") -> dict:
    """Dense vs TP from the same inputs and weights: forward, MSE loss, backward, one SGD step.

    ``inj`` is the sharded program (``tpattn.parallel.injection.Injection``, looked up from
    the bug registry by ``tpattn.bugs.modes.run``); ``mode`` is only its name, reported as
    ``"mode"``. The dense side has the injection's setup (bias, clipping: ``dense_step``).
    ``simulate``: ``"fixture"`` (the original fixture's rank-0 model, bit for bit) or ``"ranks"`` (every
    rank its own output, loss and backward, as ``tpattn.real.ranks`` measures on real
    processes). ``shard_fn(params, cfg)``: how the dense parameters are cut into rank shards
    (default: the injection's cut; chapter 6 passes a layout that splits a query/KV group).
    Returns the five measures and ``passed``. On a TP x DP mesh (``cfg.data_parallel > 1``)
    the dense side runs on the global batch ``[S, batch * data_parallel, hidden]`` and the TP
    side is rank 0's report over the DP replicas (``tp_step``: the simulated ranks of the whole
    mesh, for ``"fixture"`` too).

    ``tolerance="seed"``: the original fixture's absolute ``TOLERANCE`` and the original fixture's digits
    (``tp.tp_forward``). ``tolerance="auto"`` (a ``reduction_only`` injection): a rounding
    bound per measure (``tolerance.auto_bounds``, added as ``bounds``; the gradients and
    weights per parameter, reported for the worst one, named in ``worst_parameter``:
    ``tolerance.per_parameter``) and a ``verdict``: ``pass``, ``fail``, or ``inconclusive``
    where the step amplifies rounding as much as the difference (measured by one more dense
    step from a perturbed start, run only when a measure exceeds its bound:
    ``tolerance.apply_auto``). ``init``: ``init_params``'s ``"seed"`` (0.15) or ``"fan_in"``
    (``1/sqrt(fan_in)``). Arguments are checked by the caller (``tpattn.bugs.modes.run``)
    except ``seed``, ``simulate`` and the kernel precision ``"auto"`` needs.
    """
    check_tolerance(tolerance)
    cfg = Config() if cfg is None else cfg
    check_seed(seed)
    check_simulate(simulate)
    if tolerance == "auto":
        check_kernel_precision(cfg)
    x0, target = make_inputs(cfg, seed)
    base = make_params(cfg, seed, inj, init)
    dense = dense_step(x0, target, base, cfg, inj, dropout_masks(cfg, seed))
    if tolerance == "auto":
        dense["grad_magnitudes"] = gradient_magnitudes(x0, target, base, cfg)
    batches = rank_batches(cfg, seed, inj) if inj.inputs == "per_rank" else None
    tp = tp_step(x0, target, base, cfg, inj, simulate, shard_fn, batches, rng_seed=seed)
    metrics = five_measures(seed, mode, dense, tp)
    if tolerance == "auto":
        metrics, bounds = per_parameter(cfg, metrics, dense, tp, LR)

        def probe():  # the conditioning probe: the dense step from a perturbed start
            px, pbase = perturbed_start(cfg, x0, base)
            return conditioning(cfg, dense, dense_reference(px, target, pbase, cfg), LR,
                                metrics["worst_parameter"])

        metrics = apply_auto(metrics, bounds, probe)
    return metrics


def inspect_fixture(cfg: Config | None = None) -> dict:
    """The original fixture's ``inspect``: runtime versions, Config, dense and rank-local shapes, the rule.

    For the default float32 Config this is the original fixture's dict exactly; a float64 Config adds
    ``config["dtype"]``.
    """
    cfg = Config() if cfg is None else cfg
    config = cfg.as_dict()
    if config["dtype"] == Config.dtype:
        del config["dtype"]  # the original fixture's Config has no dtype field
    if not config["sequence_parallel"]:
        del config["sequence_parallel"]  # nor a sequence_parallel field
    if config["kv_strategy"] == Config.kv_strategy:
        del config["kv_strategy"]  # nor kv_strategy
    for name in ("data_parallel", "dropout", "qk_norm"):  # nor what surrounds the block
        if config[name] == getattr(Config, name):
            del config[name]
    extra = {}
    if has_replicas(cfg):  # fewer KV heads than ranks (tpattn.parallel.kv_heads)
        extra = {"kv_replica_groups": replica_groups(cfg), "kv_rule": (
            "each replica group holds a copy of its KV head; all-reduce wk/wv grads in the group"
            if cfg.kv_strategy == "replicate_weights" else
            "no KV copies: all-gather K/V activations; each rank slices its KV head")}
    return {
        "python": platform.python_version(),
        "pytorch": torch.__version__,
        "config": config,
        "dense_shapes": {
            "x": [cfg.seq, cfg.batch, cfg.hidden],
            "q": [cfg.seq, cfg.batch, cfg.query_heads, cfg.head_dim],
            "k_v": [cfg.seq, cfg.batch, cfg.kv_heads, cfg.head_dim],
        },
        "rank_local": {"query_heads": cfg.local_query_heads, "kv_heads": cfg.local_kv_heads},
        "rule": "keep complete query/KV groups on each rank; sum output-projection partials",
        **extra,
    }

