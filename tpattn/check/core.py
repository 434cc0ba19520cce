"""The check: one dense step and one TP step from the same start, compared on five measures.

``run(seed, mode)`` returns the seed fixture's dict — same keys, same order, same floats::

    seed, mode,
    forward_max_abs_diff, loss_abs_diff, input_grad_max_abs_diff,
    parameter_grad_max_abs_diff, post_step_weight_max_abs_diff,
    passed            (every measure < TOLERANCE)
"""
from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

from tpattn.config import Config
from tpattn.block.dense import dense_forward
from tpattn.block.kv_layout import has_replicas, kv_grad_bug_applies, replica_groups
from tpattn.block.params import clone_trainable, init_params, shard_params
from tpattn.block.sgd import sgd_step
from .magnitude import gradient_magnitudes
from .tolerance import (apply_auto, check_kernel_precision, check_tolerance, conditioning,
                        per_parameter, perturbed_start)
from tpattn.parallel.injection import Injection
from tpattn.parallel.simulated import rank0_view, simulated_step
from tpattn.parallel.one_graph import one_graph_forward
from tpattn.parallel.tp import tp_forward

EQUIVALENCE = "equivalence"
MISSING_OUTPUT_REDUCE = "missing_output_reduce"
MISSING_INPUT_GRAD_REDUCE = "missing_input_grad_reduce"
#: The three TP variants, in the seed's order.
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
#: Every mode ``run`` knows itself; ``modes_for(cfg)`` says which apply to a Config.
ALL_MODES = MODES + SP_ONLY_MODES + (MISSING_KV_GRAD_REDUCE,)
#: Each mode ``run`` knows itself as an ``Injection`` of the engine's block
#: (``tpattn.parallel.engine``): what its ranks simulation runs.
NATIVE_INJECTIONS = {EQUIVALENCE: Injection(), MISSING_OUTPUT_REDUCE: Injection(g=0),
                     MISSING_INPUT_GRAD_REDUCE: Injection(f="none"),
                     MISSING_NORM_GRAD_REDUCE: Injection(norm_grad="none"),
                     NORM_GRAD_AVERAGED: Injection(norm_grad="mean"),
                     MISSING_KV_GRAD_REDUCE: Injection(kv_grad="none")}
#: The seeds of the seed fixture's matrix.
SEEDS = (11, 17, 23, 29, 31)
#: The five measures, in the order they are reported.
MEASURES = (
    "forward_max_abs_diff",
    "loss_abs_diff",
    "input_grad_max_abs_diff",
    "parameter_grad_max_abs_diff",
    "post_step_weight_max_abs_diff",
)
#: A measure passes when it is below this (absolute; float32 rounding at the seed's size is ~1e-7).
TOLERANCE = 1e-6
#: Learning rate of the one SGD step.
LR = 0.05
#: ``init_params`` draws from ``seed + PARAM_SEED_OFFSET`` (inputs come from ``seed`` itself).
PARAM_SEED_OFFSET = 100
_SEED_MAX = 2**63 - 1 - PARAM_SEED_OFFSET
#: How ``run`` simulates the TP side. ``fixture``: the seed's model, one output (rank 0's view:
#: under a missing g only rank 0's partial exists and only its shard learns). ``ranks``: every
#: simulated rank computes its own output, loss and backward, as real ranks do.
SIMULATIONS = ("fixture", "ranks")


def check_mode(mode: str, cfg: Config | None = None) -> str:
    """Return ``mode`` if it is one of ``ALL_MODES`` and applies to ``cfg`` (``modes_for``),
    else raise ``ValueError`` naming the choices or the rule (a sequence-parallel-only mode
    without ``cfg.sequence_parallel``, or ``missing_kv_grad_reduce`` without replicated KV heads,
    says so)."""
    inj = NATIVE_INJECTIONS.get(mode) if isinstance(mode, str) else None  # its program
    if inj is not None and inj.norm_grad != "sum" \
            and not (cfg is not None and cfg.sequence_parallel):
        raise ValueError(f"mode {mode} needs sequence_parallel=True (--sequence-parallel): "
                         f"only then is the norm weight's gradient a partial sum to all-reduce")
    if inj is not None and inj.kv_grad != "sum" and cfg is not None \
            and not kv_grad_bug_applies(cfg):
        raise ValueError(
            f"mode {mode} needs replicated KV heads: kv_heads < world_size "
            f"and kv_strategy='replicate_weights' (got kv_heads={cfg.kv_heads}, "
            f"world_size={cfg.world_size}, kv_strategy={cfg.kv_strategy!r})")
    valid = modes_for(cfg) if cfg is not None else ALL_MODES
    if mode not in valid:
        raise ValueError(f"mode must be one of {', '.join(valid)} (got {mode!r})")
    return mode


def modes_for(cfg: Config | None) -> tuple[str, ...]:
    """The modes of ``cfg``'s matrix: ``SP_MODES`` under ``sequence_parallel``; ``MODES`` plus
    ``missing_kv_grad_reduce`` where KV heads are replicated; else the seed's ``MODES``."""
    if cfg is not None and cfg.sequence_parallel:
        return SP_MODES
    if cfg is not None and kv_grad_bug_applies(cfg):
        return MODES + (MISSING_KV_GRAD_REDUCE,)
    return MODES


#: Variants ``run`` computes itself; every other mode of the bug registry runs in ``tpattn.bugs.zoo``.
NATIVE_MODES = ALL_MODES

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
    """Input ``x`` and regression target, both ``[S, B, hidden]``, from the global RNG seeded
    with ``seed`` (drawn in float32, then cast to ``cfg.dtype``)."""
    torch.manual_seed(seed)
    x = torch.randn(cfg.seq, cfg.batch, cfg.hidden)
    target = torch.randn_like(x)
    return x.to(cfg.torch_dtype), target.to(cfg.torch_dtype)


#: ``max_abs_diff`` works through tensors larger than this in pieces of this many elements.
DIFF_CHUNK = 1 << 20


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` as a Python float (NaN if any difference is NaN).

    a, b: tensors of one shape (or broadcastable). Above ``DIFF_CHUNK`` elements the
    difference is taken piece by piece in one reused buffer: the same elements, the same
    maximum, without allocating (and page-faulting) a temporary as large as the tensor."""
    a, b = a.detach(), b.detach()
    n = a.numel()
    if n <= DIFF_CHUNK or a.shape != b.shape:
        return (a - b).abs().max().item()
    fa, fb = a.reshape(-1), b.reshape(-1)
    buf = torch.empty(DIFF_CHUNK, dtype=torch.result_type(a, b))
    peaks = [torch.sub(fa[i:i + DIFF_CHUNK], fb[i:i + DIFF_CHUNK],
                       out=buf[:min(DIFF_CHUNK, n - i)]).abs_().max()
             for i in range(0, n, DIFF_CHUNK)]
    return torch.stack(peaks).max().item()


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
                    cfg: Config) -> dict:
    """``one_step`` of the dense block: the side every TP variant is compared against."""
    return one_step(lambda x, p: dense_forward(x, p, cfg), x0, target, base)


def five_measures(seed: int, mode: str, dense: dict, tp: dict) -> dict:
    """``run()``'s dict from the two sides' ``one_step`` tensors: the five max-abs differences
    and ``passed`` (every one below ``TOLERANCE``)."""
    metrics = {
        "seed": seed,
        "mode": mode,
        "forward_max_abs_diff": max_abs_diff(dense["output"], tp["output"]),
        "loss_abs_diff": max_abs_diff(dense["loss"], tp["loss"]),
        "input_grad_max_abs_diff": max_abs_diff(dense["input_grad"], tp["input_grad"]),
        "parameter_grad_max_abs_diff": max(max_abs_diff(dense["grads"][k], tp["grads"][k])
                                           for k in dense["grads"]),
        "post_step_weight_max_abs_diff": max(max_abs_diff(dense["weights"][k], tp["weights"][k])
                                             for k in dense["weights"]),
    }
    metrics["passed"] = all(metrics[m] < TOLERANCE for m in MEASURES)
    return metrics


def tp_step(x0: torch.Tensor, target: torch.Tensor, base: dict[str, torch.Tensor], cfg: Config,
            mode: str, simulate: str = "fixture", shard_fn=shard_params) -> dict:
    """The TP side of ``run``: one step of the sharded block in ``mode``, simulated as
    ``simulate`` says (see ``SIMULATIONS``), in ``one_step``'s dict (rank 0's view).
    ``shard_fn(params, cfg)`` cuts the dense parameters into rank shards.

    ``"ranks"``: the engine on ``collectives.SimulatedRanks``. ``"fixture"``: under sequence
    parallelism or with replicated KV heads the engine on ``one_graph.OneGraphRanks`` (one
    graph, rank 0's view); plain TP runs the seed's ``tp.tp_forward`` (the same view, the
    seed's digits: it normalizes ``x`` once, as the dense block does, where the engine
    normalizes every rank's copy in one call, which rounds ``rsqrt`` differently in
    bfloat16)."""
    inj = NATIVE_INJECTIONS[mode]
    if check_simulate(simulate) == "ranks":  # the engine, every rank its own step
        w = cfg.world_size
        batches = list(zip(x0.chunk(w), target.chunk(w))) if cfg.sequence_parallel \
            else [(x0, target)] * w
        step = simulated_step(shard_fn(base, cfg), batches, cfg, inj, LR)
        return rank0_view(step, cfg)
    if cfg.sequence_parallel or has_replicas(cfg):
        return one_step(lambda x, p: one_graph_forward(x, p, cfg, inj, shard_fn),
                        x0, target, base)
    return one_step(lambda x, p: tp_forward(x, p, cfg, reduce_output=inj.g == 1,
                                            reduce_input_grad=inj.f == "sum",
                                            shard_fn=shard_fn),
                    x0, target, base)


def run_native(seed: int = 11, mode: str = EQUIVALENCE, cfg: Config | None = None,
        simulate: str = "fixture", shard_fn=shard_params, tolerance: str = "seed",
        init: str = "seed") -> dict:
    """Dense vs TP from the same inputs and weights: forward, MSE loss, backward, one SGD step.

    ``mode`` picks the TP variant: ``equivalence`` (both reductions), ``missing_output_reduce``
    (no g), ``missing_input_grad_reduce`` (no f); under ``cfg.sequence_parallel`` also
    ``SP_ONLY_MODES`` (see ``tpattn.parallel.sequence_parallel``); ``missing_kv_grad_reduce`` (no
    replica-group reduce of wk/wv; only where KV heads are replicated, see ``modes_for``).
    ``simulate``: ``"fixture"`` (the seed's
    rank-0 model, bit for bit) or ``"ranks"`` (every rank its own output, loss and backward,
    as ``tpattn.real.ranks`` measures on real processes). ``shard_fn(params, cfg)``: how the
    dense parameters are cut into rank shards (default ``shard_params``; chapter 6 passes a
    layout that splits a query/KV group). Returns the five measures and
    ``passed``. Any other mode of the bug registry runs in ``tpattn.bugs.zoo.run``.

    ``tolerance="seed"``: the seed's absolute ``TOLERANCE`` and the seed's digits
    (``tp.tp_forward``). ``tolerance="auto"``: a rounding bound per measure
    (``tolerance.auto_bounds``, added as ``bounds``; the gradients and weights per parameter,
    reported for the worst one, named in ``worst_parameter``: ``tolerance.per_parameter``)
    and a ``verdict``: ``pass``, ``fail``, or ``inconclusive`` where the step amplifies
    rounding as much as the difference (measured by one more dense step from a perturbed
    start, run only when a measure exceeds its bound: ``tolerance.apply_auto``).
    ``init``: ``init_params``'s ``"seed"`` (0.15) or ``"fan_in"`` (``1/sqrt(fan_in)``).
    """
    check_tolerance(tolerance)
    cfg = Config() if cfg is None else cfg
    check_mode(mode, cfg)
    check_seed(seed)
    check_simulate(simulate)
    if tolerance == "auto":
        check_kernel_precision(cfg)
    x0, target = make_inputs(cfg, seed)
    base = init_params(cfg, seed + PARAM_SEED_OFFSET, init)
    dense = dense_reference(x0, target, base, cfg)
    if tolerance == "auto":
        dense["grad_magnitudes"] = gradient_magnitudes(x0, target, base, cfg)
    tp = tp_step(x0, target, base, cfg, mode, simulate, shard_fn)
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
    """The seed's ``inspect``: runtime versions, Config, dense and rank-local shapes, the rule.

    For the default float32 Config this is the seed's dict exactly; a float64 Config adds
    ``config["dtype"]``.
    """
    cfg = Config() if cfg is None else cfg
    config = cfg.as_dict()
    if config["dtype"] == Config.dtype:
        del config["dtype"]  # the seed's Config has no dtype field
    if not config["sequence_parallel"]:
        del config["sequence_parallel"]  # nor a sequence_parallel field
    if config["kv_strategy"] == Config.kv_strategy:
        del config["kv_strategy"]  # nor kv_strategy
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

