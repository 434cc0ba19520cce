"""The check: one dense step and one TP step (the program ``inj``, an ``Injection``) from the
same start, compared on the five ``MEASURES`` (``check_injection``)."""
from __future__ import annotations

import platform
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from tpattn.config import Config
from tpattn.block.dense import dense_forward
from tpattn.block.fused_qkv import fuse_qkv_weight, load_qkv_weight
from tpattn.block.kv_layout import has_replicas, replica_groups
from tpattn.block.params import (INIT_STD, PARAM_NAMES, QK_NORM_NAMES, clone_trainable,
                                 dense_shapes, init_params, rank_head_slices, shard_params,
                                 unshard_params)
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
#: Variants only under sequence parallelism: the norm gradient's all-reduce dropped or averaged.
SP_ONLY_MODES = (MISSING_NORM_GRAD_REDUCE, NORM_GRAD_AVERAGED)
#: Every variant valid under sequence parallelism (``--mode matrix`` runs them all).
SP_MODES = MODES + SP_ONLY_MODES
#: The replica-group reduce of wk/wv dropped (only where KV heads are replicated).
MISSING_KV_GRAD_REDUCE = "missing_kv_grad_reduce"
#: Every mode of the original fixture's check (``tpattn.bugs.modes.modes_for``: which apply).
ALL_MODES = MODES + SP_ONLY_MODES + (MISSING_KV_GRAD_REDUCE,)
#: The seeds of the original fixture's matrix.
SEEDS = (11, 17, 23, 29, 31)
#: Learning rate of the one SGD step.
LR = 0.05
#: ``init_params`` draws from ``seed + PARAM_SEED_OFFSET`` (inputs come from ``seed`` itself).
PARAM_SEED_OFFSET = 100
_SEED_MAX = 2**63 - 1 - PARAM_SEED_OFFSET
#: How ``run`` simulates the TP side: ``fixture``, rank 0's view in one graph (the original
#: fixture's); ``ranks``, every rank its own output, loss and backward, as real ranks.
SIMULATIONS = ("fixture", "ranks")


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """``value`` if it is an integer in ``[low, high]`` (or ``>= low``), else ``ValueError``."""
    rule = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        raise ValueError(f"{name} must be {rule} (got {value!r})")
    return value


def check_seed(seed: int) -> int:
    """``check_int`` of a seed: an integer in ``[0, 2**63 - 101]``."""
    return check_int("seed", seed, 0, _SEED_MAX)


def check_count(name: str, value: int) -> int:
    """``check_int`` of a count: an integer >= 1."""
    return check_int(name, value, 1)


def check_simulate(simulate: str) -> str:
    """Return ``simulate`` if it is one of ``SIMULATIONS``, else raise ``ValueError``."""
    if simulate not in SIMULATIONS:
        raise ValueError(f"simulate must be one of {', '.join(SIMULATIONS)} (got {simulate!r})")
    return simulate


def make_inputs(cfg: Config, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ``x`` and target, ``[S, B * data_parallel, hidden]``, drawn in float32 from the
    global RNG seeded with ``seed``, cast to ``cfg.dtype``."""
    torch.manual_seed(seed)
    x = torch.randn(cfg.seq, cfg.batch * cfg.data_parallel, cfg.hidden)
    target = torch.randn_like(x)
    return x.to(cfg.torch_dtype), target.to(cfg.torch_dtype)


def assert_close_within(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float,
                        atol: float, what: str = "values") -> None:
    """Raise ``AssertionError`` unless ``|actual - expected| <= atol + rtol * |expected|``
    elementwise (``torch.isclose``; NaN never matches), naming ``what``, how many elements are
    off and the worst one. ``ValueError`` for tensors of two shapes or dtypes."""
    for name, value in (("actual", actual), ("expected", expected)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor (got {type(value).__name__})")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite number >= 0 (got {value!r})")
    for rule, a, e in (("shape", list(actual.shape), list(expected.shape)),
                       ("dtype", actual.dtype, expected.dtype)):
        if a != e:
            raise ValueError(f"{what}: actual and expected must have one {rule} (got {a} and {e})")
    actual, expected = actual.detach(), expected.detach()
    matches = torch.isclose(actual, expected, rtol=rtol, atol=atol)
    if bool(matches.all()):
        return
    diff = actual - expected if actual.is_complex() else actual.double() - expected.double()
    gap = diff.abs().double().nan_to_num(nan=float("inf")).where(~matches, -1.0)
    worst = int(gap.argmax())  # the worst of the elements that fail
    where = [int(i) for i in np.unravel_index(worst, actual.shape)]
    off = int((~matches).sum())
    raise AssertionError(
        f"{what}: {off} of {matches.numel()} elements differ by more than "
        f"atol + rtol * |expected| (atol={atol:g}, rtol={rtol:g}); the largest of them, "
        f"|actual - expected| = {diff.abs().flatten()[worst].item():.3e} at index {where} "
        f"(actual {actual.flatten()[worst].item():.6g}, "
        f"expected {expected.flatten()[worst].item():.6g})")


def _stepped(x: torch.Tensor, p: dict[str, torch.Tensor], y: torch.Tensor, loss: torch.Tensor,
             clip=None) -> dict:
    """After backward: ``one_step``'s dict, SGD scaled by ``clip(grads)`` (default 1)."""
    grads = {k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in p.items()}
    weights = sgd_step(p, grads, LR, 1.0 if clip is None else float(clip(grads)))
    return {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad,
            "grads": grads, "weights": weights}


def one_step(forward, x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor],
             clip=None) -> dict:
    """One step from a copy of ``base``: ``forward(x, params) -> y``, MSE loss, backward, SGD
    scaled by ``clip(grads)`` (default 1). x0, target: ``[S, B, hidden]``. Returns ``output``,
    ``loss``, ``input_grad``, ``grads`` (zeros where none) and ``weights`` (after the step)."""
    p = clone_trainable(base)
    x = x0.clone().requires_grad_(True)
    y = forward(x, p)
    loss = F.mse_loss(y, target)
    loss.backward()
    return _stepped(x, p, y, loss, clip)


def ranks_step(forward_ranks, x0: torch.Tensor, target: torch.Tensor,
               shards: list[dict[str, torch.Tensor]]) -> list[dict]:
    """``one_step`` on every simulated rank (``forward_ranks(xs, ps) -> ys``), one backward of
    the losses' sum: one ``one_step`` dict per rank (its shards)."""
    ps = [clone_trainable(shard) for shard in shards]
    xs = [x0.clone().requires_grad_(True) for _ in shards]
    ys = forward_ranks(xs, ps)
    losses = [F.mse_loss(y, target) for y in ys]
    sum(losses[1:], losses[0]).backward()
    return [_stepped(*step) for step in zip(xs, ps, ys, losses)]


def dense_reference(x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor],
                    cfg: Config, masks: dict[str, torch.Tensor] | None = None) -> dict:
    """``one_step`` of the dense block (``masks``: ``dense_forward``'s dropout masks)."""
    return one_step(lambda x, p: dense_forward(x, p, cfg, masks), x0, target, base)


def probe_step(cfg: Config, x0: torch.Tensor, target: torch.Tensor,
               base: dict[str, torch.Tensor]) -> dict:
    """The conditioning probe: ``dense_reference`` from ``tolerance.perturbed_start``."""
    px, pbase = perturbed_start(cfg, x0, base)
    return dense_reference(px, target, pbase, cfg)


# --- an injection's program: its parameters, its ranks' inputs, its cut --------------------

#: The optional output bias is drawn from ``seed + this`` (the other parameters unchanged).
BIAS_SEED_OFFSET = 200
#: Under ``inputs="per_rank"`` rank ``r >= 1`` draws its batch from ``seed + this * r``.
OTHER_BATCH_SEED_OFFSET = 7919
#: The q/k-norm weights are drawn from ``seed + this`` (the other parameters unchanged).
QK_NORM_SEED_OFFSET = 300


def dropout_masks(cfg: Config, seed: int) -> dict[str, torch.Tensor] | None:
    """The dropout masks of the correct program's step (tiled along a mesh's global batch),
    what the dense reference applies; ``None`` when ``cfg.dropout == 0``."""
    if cfg.dropout == 0:
        return None
    return tile_masks(replica_masks(cfg, seed), cfg.data_parallel)


def make_params(cfg: Config, seed: int, inj: Injection, init: str = "seed") -> dict[str, torch.Tensor]:
    """``init_params(cfg, seed + PARAM_SEED_OFFSET, init)``, plus the injection's output bias
    ``[hidden]`` and, with ``cfg.qk_norm``, ``q_norm``/``k_norm`` ``[head_dim]`` = ``1 +
    INIT_STD * randn`` (not ones, so a gradient that misses heads shows)."""
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


#: ``Injection.shard`` -> (fused checkpoint layout, how a rank reads it, passes ``tp_rank``).
LOADERS = {"fused_rank0": ("plain", "plain", False), "grouped": ("grouped", "grouped", True),
           "grouped_as_plain": ("grouped", "plain", True)}


def load_rank_shard(p: dict[str, torch.Tensor], cfg: Config, inj: Injection,
                    rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` loads from the dense ``p`` with the injection's loader (``LOADERS``:
    ``wq``/``wk``/``wv`` from the fused checkpoint, ``wo`` its heads' columns, ``norm`` and
    ``bias`` replicated; else ``shard(...)[rank]``); differentiable."""
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
    """Every rank's parameters as the injection's loader cuts them (differentiable slices of
    ``p``): ``shard_params``, contiguous ``[Wq; Wk; Wv]`` rows (``"fused_naive"``) or
    ``load_rank_shard``; ``shard_offset`` k: rank r gets rank ``(r + k) mod W``'s."""
    if inj.shard in LOADERS:
        base = replace(inj, shard_offset=0)
        shards = [load_rank_shard(p, cfg, base, r) for r in range(cfg.world_size)]
    elif inj.shard != "fused_naive":
        shards = shard_params({k: p[k] for k in PARAM_NAMES}, cfg)
    else:
        fused = torch.cat([p["wq"], p["wk"], p["wv"]])
        q, kv = cfg.local_query_heads * cfg.head_dim, cfg.local_kv_heads * cfg.head_dim
        n = fused.shape[0] // cfg.world_size  # rank r: rows [r n, (r + 1) n)
        shards = []
        for rank in range(cfg.world_size):
            rows = fused[rank * n:(rank + 1) * n]
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
    """Full-size tensors from every rank's: ``inverse_of`` the injection's ``shard``, each
    element from the first rank that holds it (``norm``, ``bias``, q/k-norm: rank 0's);
    ``"fused_rank0"`` puts rank r's tensors on rank r's heads, as saving does."""
    cut = replace(inj, shard="heads") if inj.shard == "fused_rank0" else inj
    first, shapes = shards[0], dense_shapes(cfg)
    like = {k: first[k].new_zeros(shapes.get(k, first[k].shape))
            for k in PARAM_NAMES + ("bias",) + QK_NORM_NAMES if k in first}
    return inverse_of(lambda p, c: shard(p, c, cut), like, cfg)(shards)


def inverse_of(shard_fn, like: dict[str, torch.Tensor], cfg: Config):
    """The gather of a cut ``shard_fn(p, cfg)``: per-rank dicts -> full-size tensors shaped as
    ``like``, each element from the first rank that holds it, under whichever name the cut
    gives it; ``unshard_params`` where the cut is a copy, not a view."""
    leaves = {k: torch.zeros_like(v).requires_grad_(True) for k, v in like.items()}
    cuts = shard_fn(leaves, cfg)
    if not all(t.requires_grad for c in cuts for t in c.values()):
        return lambda per_rank: unshard_params(per_rank, cfg)

    def gather(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        full = {name: torch.zeros_like(leaf).detach() for name, leaf in leaves.items()}
        for cut, got in reversed(list(zip(cuts, per_rank))):
            names = [k for k in cut if k in got]
            value, held = (torch.autograd.grad(
                [cut[k] for k in names], list(leaves.values()), [fill(got[k]) for k in names],
                retain_graph=True, allow_unused=True) for fill in (torch.detach, torch.ones_like))
            for (name, out), v, h in zip(list(full.items()), value, held):
                if h is not None:
                    full[name] = torch.where(h > 0, v / h.clamp(min=1), out)
        return full
    return gather


def rank_batches(cfg: Config, seed: int, inj: Injection) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's ``(x, target)`` ``[S, B, hidden]``, mesh order: ``make_inputs``'s batch
    (``inputs="per_rank"``: rank r's from ``seed + OTHER_BATCH_SEED_OFFSET * r``), on a mesh
    replica d's columns of it."""
    first = make_inputs(cfg, seed)
    per_tp = [first] * cfg.world_size if inj.inputs != "per_rank" else [first] + [
        make_inputs(cfg, seed + OTHER_BATCH_SEED_OFFSET * r) for r in range(1, cfg.world_size)]
    if cfg.data_parallel == 1:
        return per_tp
    return [replica_batch(per_tp[t], cfg, d) for d in range(cfg.data_parallel)
            for t in range(cfg.world_size)]


def replica_batch(batch: tuple[torch.Tensor, torch.Tensor], cfg: Config,
                  d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DP replica ``d``'s ``(x, target)``: columns ``d*B:(d+1)*B`` of the global batch."""
    cols = slice(d * cfg.batch, (d + 1) * cfg.batch)
    return batch[0][:, cols], batch[1][:, cols]


def block_inputs(batches: list[tuple[torch.Tensor, torch.Tensor]],
                 cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's ``(x, target)`` as its block takes it: its tokens ``[S/W, B, hidden]``
    under ``cfg.sequence_parallel``, else the batch."""
    if not cfg.sequence_parallel:
        return list(batches)
    return [(x[rank_tokens(cfg, i % cfg.world_size)], t[rank_tokens(cfg, i % cfg.world_size)])
            for i, (x, t) in enumerate(batches)]


def clip_coef(norm: torch.Tensor, inj: Injection) -> float:
    """``min(1, MAX_GRAD_NORM / (norm + 1e-6))`` under ``inj.clip``, else 1."""
    return min(1.0, MAX_GRAD_NORM / (float(norm) + 1e-6)) if inj.clip else 1.0


def dense_step(x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor],
               cfg: Config, inj: Injection,
               masks: dict[str, torch.Tensor] | None = None) -> dict:
    """``one_step`` of the dense block with the injection's output bias and clipping (by
    ``engine.grad_norm`` of the dense block as a one-rank job); ``masks``: ``dropout_masks``."""
    one_rank = SimulatedRanks(replace(cfg, world_size=1, data_parallel=1))

    def forward(x, p):
        y = dense_forward(x, p, cfg, masks)
        return y + p["bias"] if "bias" in p else y

    def clip(grads):
        return clip_coef(grad_norm(stack_ranks([grads]), one_rank), inj)
    return one_step(forward, x0, target, base, clip if inj.clip else None)


def fixture_step(x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor],
                 cfg: Config, inj: Injection, shard_fn, others=None) -> dict:
    """``one_step`` of the engine's block in one graph (rank 0's view, shards ``shard_fn(p, cfg)``)
    clipped by ``engine.grad_norm`` of the ranks' shards; ``others``: ranks >= 1's own inputs."""
    def clip(grads):
        per_rank = shard(grads, cfg, replace(inj, shard="heads" if inj.shard in
                                             ("fused_naive", *LOADERS) else inj.shard))
        return clip_coef(grad_norm(stack_ranks(per_rank), SimulatedRanks(cfg), inj), inj)
    return one_step(lambda x, p: one_graph_forward(x, p, cfg, inj, shard_fn, others),
                    x0, target, base, clip)


def original_program(inj: Injection, cfg: Config) -> bool:
    """The original fixture's programs (f and g kept or dropped) on plain TP, which
    ``tp_forward`` runs to keep the original fixture's digits bit for bit."""
    return inj.f in ("sum", "none") and inj.g in (0, 1) and not cfg.sequence_parallel \
        and replace(inj, f="sum", g=1, norm_grad="sum", kv_grad="sum") == Injection() \
        and not has_replicas(cfg)


def _ranks_view(base, cfg: Config, inj: Injection, cut, gather, batches, rng_seed) -> dict:
    """``simulated_step`` of every rank of the job, as rank 0 sees it (or ``mesh_view``)."""
    rng = simulated_streams(cfg, rng_seed, inj) if cfg.dropout > 0 else None
    step = simulated_step(cut(base, cfg) * cfg.data_parallel, block_inputs(batches, cfg), cfg,
                          inj, LR, rng=rng)
    return (mesh_view if cfg.data_parallel > 1 else rank0_view)(step, cfg, gather)


def tp_step(x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor], cfg: Config,
            inj: Injection, simulate: str = "fixture", shard_fn=None, batches=None,
            rng_seed: int | None = None) -> dict:
    """The TP side: one step of the block wired as ``inj``, rank 0's view, ``one_step``'s dict.
    ``shard_fn``: the cut (default ``shard``); ``batches``: every rank's ``(x, target)``;
    ``rng_seed``: the run's seed (dropout). ``"ranks"``, a mesh, a model option or an aliasing
    loader run the simulated ranks; else one graph (``original_program``: ``tp_forward``)."""
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
        gather = inverse_of(shard_fn, base, cfg) if shard_fn else (
            lambda per_rank: unshard(per_rank, cfg, inj))
        return _ranks_view(base, cfg, inj, cut, gather, batches, rng_seed)
    if original_program(inj, cfg):
        return one_step(lambda x, p: tp_forward(x, p, cfg, reduce_output=inj.g == 1,
                                                reduce_input_grad=inj.f == "sum",
                                                shard_fn=shard_fn or shard_params),
                        x0, target, base)
    others = [b[0] for b in batches[1:]] if inj.inputs == "per_rank" else None
    views = shard_fn is None and inj.shard in ("heads", "fused") and not inj.shard_offset \
        and not has_replicas(cfg)  # the loader hands rank r its own heads' rows
    return fixture_step(x0, target, base, cfg, inj, shard_params if views else cut, others)


def check_injection(seed: int, mode: str, inj: Injection, cfg: Config | None = None,
                    simulate: str = "fixture", shard_fn=None, tolerance: str = "seed",
                    init: str = "seed") -> dict:
    """Dense (``dense_step``) vs TP (``tp_step``, the program ``inj`` named ``mode``) from the
    same inputs and weights: forward, MSE loss, backward, one SGD step. Returns the five
    measures and ``passed`` (``tolerance="seed"``: below ``TOLERANCE``; ``"auto"``:
    ``tolerance.apply_auto``'s dict, the conditioning probe run only when a measure exceeds
    its bound). ``init``: ``"seed"`` (0.15) or ``"fan_in"``."""
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
        worst = metrics["worst_parameter"]  # the probe runs only when a bound is exceeded
        metrics = apply_auto(metrics, bounds, lambda: conditioning(
            cfg, dense, probe_step(cfg, x0, target, base), LR, worst))
    return metrics


def inspect_fixture(cfg: Config | None = None) -> dict:
    """The original fixture's ``inspect``: runtime versions, Config (later fields left out at
    their default), dense and rank-local shapes, the rule."""
    cfg = Config() if cfg is None else cfg
    later = ("dtype", "sequence_parallel", "kv_strategy", "data_parallel", "dropout", "qk_norm")
    config = {k: v for k, v in cfg.as_dict().items() if k not in later or v != getattr(Config, k)}
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

