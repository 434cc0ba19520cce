"""Part II, splitting the block across ranks (chapters 6-10): the shards, f and g in an MLP and
its fused gate/up weight, the missing reductions' signatures and fingerprint, reading them."""
from __future__ import annotations

import functools
import random
from itertools import combinations

import torch
import torch.nn.functional as F

from tpattn.block.dense import attend_and_project, dense_forward
from tpattn.block.layers import rms_norm
from tpattn.block.params import PARAM_NAMES, clone_trainable, shard_params
from tpattn.bugs.modes import run
from tpattn.check.core import (EQUIVALENCE, MEASURES, MISSING_INPUT_GRAD_REDUCE,
                               MISSING_OUTPUT_REDUCE, MODES, TOLERANCE)
from tpattn.config import Config
from tpattn.exercises.graders import (CHECKED_CONFIGS, CHECKED_SEEDS, Wrong, as_names, cases,
                                      counted, coverage, exercise, expect_shape, failing,
                                      first_near, grade_prediction, head_of, near, rank_dicts,
                                      shape_text, tensor, tensor_list)
from tpattn.parallel.tp import tp_forward

# --- chapter 6 ------------------------------------------------------------------------------


def _heads_held(shard: torch.Tensor, dense: torch.Tensor, d: int, what: str, rank: int) -> list:
    """The dense heads ``shard``'s blocks of ``d`` rows are, in order, else ``Wrong``."""
    heads = []
    for i in range(shard.shape[0] // d):
        h = head_of(shard[i * d:(i + 1) * d].detach(), dense.detach(), d)
        if h is None:
            raise Wrong(f"rank {rank}'s {what} rows {i * d}..{(i + 1) * d - 1} are not one "
                        f"whole head of the dense {what}: a head's head_dim rows stay together.")
        heads.append(h)
    return heads


def _rank_heads(mine, params: dict, cfg: Config, rank: int) -> tuple[list[int], list[int]]:
    """The query and KV heads rank ``rank``'s shard holds; ``Wrong`` for a wrong shape, a split
    head or group, or wo columns of other heads."""
    d, g = cfg.head_dim, cfg.group_size
    expected = shard_params(params, cfg)[rank]  # the package's shard, for its shapes
    if not isinstance(mine, dict) or any(k not in mine for k in PARAM_NAMES):
        raise Wrong(f"rank {rank}'s shard should be a dict with the keys {', '.join(PARAM_NAMES)}.")
    for k in PARAM_NAMES:
        expect_shape(tensor(mine[k], f"rank {rank}'s {k}"), expected[k].shape,
                     f"for {shape_text(cfg)}, rank {rank}'s {k}")
    q = _heads_held(mine["wq"], params["wq"], d, "wq", rank)
    kv = _heads_held(mine["wk"], params["wk"], d, "wk", rank)
    if _heads_held(mine["wv"], params["wv"], d, "wv", rank) != kv:
        raise Wrong(f"rank {rank} holds other heads of wv than of wk; a KV head's "
                    f"key and value rows go together.")
    o = _heads_held(mine["wo"].t(), params["wo"].t(), d, "wo column", rank)
    if o != q:
        raise Wrong(f"rank {rank}'s wo columns belong to query heads {o}, but it computes query "
                    f"heads {q}: wo's columns must match the rank's own heads.")
    for i, h in enumerate(q):
        if h // g not in kv:
            raise Wrong(f"for {shape_text(cfg)}, rank {rank} holds query heads {q} and KV heads "
                        f"{kv}: query head {h} reads KV head {h // g}, which is not on rank "
                        f"{rank} — a split group.")
        if kv[i // g] != h // g:
            raise Wrong(f"rank {rank} holds the right heads in the wrong order: its query head "
                        f"{h} would read KV head {kv[i // g]} (repeat_kv pairs local query "
                        f"head i with local KV head i // group_size).")
    return q, kv


def _grade_sharded_block(shard, cfg: Config, seed: int, x0, params: dict) -> None:
    """``Wrong`` unless gradients reach ``params`` and the sharded block passes."""
    tp_forward(x0, params, cfg, shard_fn=shard).sum().backward()
    unreached = [k for k in PARAM_NAMES if params[k].grad is None]
    fails = failing(run(seed, EQUIVALENCE, cfg, shard_fn=shard)) if not unreached else \
        ["parameter_grad_max_abs_diff"]
    if fails and "forward_max_abs_diff" not in fails:
        none = f" ({', '.join(unreached)} get none)" if unreached else ""
        raise Wrong(f"every rank holds the right heads and the forward matches, but the "
                    f"gradients do not reach the dense parameters{none}: a shard must be a "
                    f"differentiable slice of params (no detach, no new tensor).")
    if fails:
        raise Wrong(f"the sharded block differs from dense for seed {seed}, "
                    f"{shape_text(cfg)} (fails {', '.join(fails)}).")


@exercise("shard_params", 6)
def check_shard_params(shard) -> str:
    """Check ``shard(params, cfg) -> list[dict]``: per rank ``norm`` and its heads' rows of
    ``wq``, ``wk``, ``wv`` and columns of ``wo``, as differentiable slices."""
    for cfg, seed, x0, target, base in cases():
        params = clone_trainable(base)
        shards = rank_dicts(shard(params, cfg), cfg)
        held = [_rank_heads(mine, params, cfg, rank) for rank, mine in enumerate(shards)]
        held_q = sorted(h for q, _ in held for h in q)
        held_kv = sorted(h for _, kv in held for h in kv)
        if held_q != list(range(cfg.query_heads)) or held_kv != list(range(cfg.kv_heads)):
            raise Wrong(f"for {shape_text(cfg)} some head is on two ranks or on none (query "
                        f"heads held: {held_q}, KV heads: {held_kv}).")
        _grade_sharded_block(shard, cfg, seed, x0, params)
    return (f"every rank holds complete query/KV groups with the matching wo columns, "
            f"gradients reach the dense parameters, and tpattn.run(..., shard_fn=yours) "
            f"passes all five measures for {coverage()}.")


def _layout_shard_fn(layout):
    """A ``shard_fn`` giving rank r the heads ``layout[r]["query"]`` and ``layout[r]["kv"]``."""

    def shard_fn(params, cfg):
        def rows(heads):
            return torch.tensor([h * cfg.head_dim + i for h in sorted(heads)
                                 for i in range(cfg.head_dim)])

        return [{"norm": params["norm"], "wq": params["wq"][rows(r["query"])],
                 "wk": params["wk"][rows(r["kv"])], "wv": params["wv"][rows(r["kv"])],
                 "wo": params["wo"][:, rows(r["query"])]} for r in layout]

    return shard_fn


def _layouts(cfg: Config, rng: random.Random) -> list[list[dict]]:
    """Layouts: the package's, groups moved, query heads shuffled, one query head swapped."""
    w, g = cfg.world_size, cfg.group_size
    lq, lkv = cfg.local_query_heads, cfg.local_kv_heads

    def from_lists(query, kv):
        return [{"query": sorted(query[r * lq:(r + 1) * lq]),
                 "kv": sorted(kv[r * lkv:(r + 1) * lkv])} for r in range(w)]

    package = from_lists(list(range(cfg.query_heads)), list(range(cfg.kv_heads)))
    layouts = [package]
    for _ in range(2):  # whole groups moved to other ranks
        kv = list(range(cfg.kv_heads))
        rng.shuffle(kv)
        layouts.append(from_lists([k * g + i for k in kv for i in range(g)], kv))
    for _ in range(2):  # query heads shuffled, KV heads where the package puts them
        query = list(range(cfg.query_heads))
        rng.shuffle(query)
        layouts.append(from_lists(query, list(range(cfg.kv_heads))))
    swapped = [list(r["query"]) for r in package]
    swapped[0][-1], swapped[-1][0] = swapped[-1][0], swapped[0][-1]
    layouts.append([{"query": sorted(q), "kv": r["kv"]} for q, r in zip(swapped, package)])
    return layouts


@exercise("detect a split group", 6)
def check_keeps_groups(keeps_groups) -> str:
    """Check ``keeps_groups(layout, cfg) -> bool``: whether a layout (per rank the sorted lists
    ``"query"`` and ``"kv"`` of its heads) keeps every group on one rank."""
    rng = random.Random(13)
    layouts = [(cfg, layout) for cfg in CHECKED_CONFIGS for layout in _layouts(cfg, rng)]
    for cfg, layout in layouts:
        truth = run(11, EQUIVALENCE, cfg, shard_fn=_layout_shard_fn(layout))["passed"]
        given = [{"query": list(p["query"]), "kv": list(p["kv"])} for p in layout]
        answer = keeps_groups(given, cfg)
        if not isinstance(answer, bool) and not (
                isinstance(answer, torch.Tensor) and answer.numel() == 1):
            raise Wrong(f"your function should return True or False, but it gave "
                        f"{type(answer).__name__}.")
        if bool(answer) != truth:
            verdict = ("keeps groups complete, but the sharded block with this layout differs "
                       "from dense" if answer else
                       "splits a group, but the sharded block with this layout matches dense on "
                       "all five measures")
            text = "; ".join(f"rank {r}: query {part['query']}, KV {part['kv']}"
                             for r, part in enumerate(layout))
            raise Wrong(f"for {shape_text(cfg)} and the layout {text}, you said it {verdict}.")
    return (f"right on all {len(layouts)} layouts (three shapes, the package's layout, groups "
            f"moved between ranks and shuffled heads), each graded by running the sharded block.")


# --- chapter 7 ------------------------------------------------------------------------------

#: (seq, batch, hidden, intermediate, world_size) of the MLP exercises.
_MLP_SHAPES = ((5, 2, 16, 32, 2), (3, 1, 8, 24, 4))


def _mlp_cases(fused: bool):
    """``(w, hidden, inter, seed, n, fc1, fc2)`` per MLP shape × seed; trainable ``n`` ``[S, B,
    hidden]``, ``fc1`` ``[I, hidden]`` (``fused``: ``[2I, hidden]``), ``fc2`` ``[hidden, I]``."""
    for s, b, hidden, inter, w in _MLP_SHAPES:
        for seed in CHECKED_SEEDS:
            gen = torch.Generator().manual_seed(seed)
            n = torch.randn(s, b, hidden, generator=gen)
            fc1 = torch.randn(inter * (2 if fused else 1), hidden, generator=gen) / hidden ** 0.5
            fc2 = torch.randn(hidden, inter, generator=gen) / inter ** 0.5
            yield w, hidden, inter, seed, *(t.requires_grad_(True) for t in (n, fc1, fc2))


def _mlp(n: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, fused: bool) -> torch.Tensor:
    """GELU MLP ``fc2(gelu(fc1 n))``, or (``fused``) SwiGLU with ``fc1`` = gate rows then up."""
    if fused:
        gate, up = fc1.chunk(2)
        return F.linear(F.silu(F.linear(n, gate)) * F.linear(n, up), fc2)
    return F.linear(F.gelu(F.linear(n, fc1)), fc2)


_GRAD_HINTS = {"n": "every rank's copy of n must stay in the graph, so that the backward "
                    "sums the ranks' dn — that is f",
               "gate_up": "cut the shards from gate_up by slicing and torch.cat, so that "
                          "gradients flow back to it"}


def _grads_match(out, want, leaves: dict, where: str) -> None:
    """``Wrong`` unless ``out`` and ``want`` give the named ``leaves`` the same gradients."""
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    mine = torch.autograd.grad(out, list(leaves.values()), cot, allow_unused=True)
    ref = torch.autograd.grad(want, list(leaves.values()), cot)
    for name, g, r in zip(leaves, mine, ref):
        if g is None or not near(g, r, 64):
            hint = _GRAD_HINTS.get(name, f"compute from {name} itself, not a copy")
            raise Wrong(f"{where}, the gradient of {name} differs from the dense MLP's: {hint}.")


@exercise("f and g in the MLP", 7)
def check_tp_mlp(tp_mlp) -> str:
    """Check ``tp_mlp(n, fc1, fc2, world_size, g)``: the GELU MLP on a list of ranks, rank r
    holding intermediate features block r; ``g`` (given) sums the list of partial outputs."""
    for w, hidden, inter, seed, n, fc1, fc2 in _mlp_cases(fused=False):
        calls = []
        out = tp_mlp(n, fc1, fc2, w, lambda parts: calls.append(list(parts)) or sum(parts))
        where = f"with {w} ranks (hidden {hidden}, {inter} features), seed {seed}"
        if len(calls) != 1:
            raise Wrong(f"{where}, your code called g {len(calls)} times; it should call it "
                        f"once, on the list of the ranks' partial outputs.")
        parts = calls[0]
        if len(parts) != w or not all(isinstance(p, torch.Tensor) for p in parts):
            raise Wrong(f"{where}, g should get a list of {w} tensors, one partial per rank.")
        block = inter // w
        for r, part in enumerate(parts):
            rows = slice(r * block, (r + 1) * block)
            span = f"{rows.start}..{rows.stop - 1}"
            first_near(part, [(_mlp(n, fc1[rows], fc2[:, rows], False), block, None)],
                       f"{where}, rank {r}'s partial is not fc2's columns {span} applied to gelu "
                       f"of fc1's rows {span} times n: each rank holds a contiguous block of the "
                       f"intermediate features, fc1 by rows and fc2 by columns.")
        want = _mlp(n, fc1, fc2, False)
        if not near(tensor(out, "tp_mlp's output"), want, inter):
            raise Wrong(f"{where}, the output is not the dense MLP's: return g's sum.")
        _grads_match(out, want, {"n": n, "fc1": fc1, "fc2": fc2}, where)
    return (f"every rank's partial, the output and the gradients of n, fc1 and fc2 equal the "
            f"dense MLP's for {counted(_MLP_SHAPES, CHECKED_SEEDS, ', 2 and 4 ranks')}.")


@exercise("a fused gate/up weight", 7)
def check_gate_up_shards(shard_gate_up) -> str:
    """Check ``shard_gate_up(gate_up, world_size)``: rank r's ``[2I/W, hidden]`` shard is its
    block of gate rows then the same block of up rows, cut differentiably from ``gate_up``."""
    for w, hidden, inter, seed, n, gate_up, fc2 in _mlp_cases(fused=True):
        block = inter // w
        shards = tensor_list(shard_gate_up(gate_up, w), w, [2 * block, hidden], "shard")
        gate, up = gate_up.detach().chunk(2)
        where = f"with {w} ranks ({inter} features), seed {seed}"
        for r, shard in enumerate(shards):
            rows = slice(r * block, (r + 1) * block)
            cut = slice(2 * r * block, 2 * (r + 1) * block)
            if torch.equal(shard.detach(), gate_up.detach()[cut]):
                raise Wrong(f"{where}, rank {r}'s shard is rows {cut.start}..{cut.stop - 1} of "
                            f"the fused weight, which are not the gate and up rows of the same "
                            f"features: cut gate and up each by rank, then stack them.")
            if not torch.equal(shard.detach(), torch.cat([gate[rows], up[rows]])):
                raise Wrong(f"{where}, rank {r}'s shard is not gate rows {rows.start}.."
                            f"{rows.stop - 1} followed by the same rows of up.")
        out = sum(_mlp(n, s, cols, True) for s, cols in zip(shards, fc2.chunk(w, dim=1)))
        _grads_match(out, _mlp(n, gate_up, fc2, True), {"gate_up": gate_up}, where)
    return (f"every rank holds its gate rows and the matching up rows, and the sharded SwiGLU "
            f"MLP's gradient reaches gate_up equal to dense on {len(_MLP_SHAPES)} shapes (2 "
            f"and 4 ranks) × {len(CHECKED_SEEDS)} seeds.")


# --- chapters 8 and 9: predictions ----------------------------------------------------------

@exercise("predict missing g's signature", 8)
def check_missing_g_signature(predict) -> str:
    """Check ``predict() -> set``: the measures (``tpattn.MEASURES``) that fail without g."""
    return grade_prediction(predict, MISSING_OUTPUT_REDUCE)


@exercise("the fingerprint of a missing g", 8)
def check_fingerprint(fingerprint) -> str:
    """Check ``fingerprint(x, params, cfg) -> [S, B, hidden]``: dense minus the block without g."""
    for cfg, seed, x0, target, base in cases():
        with torch.no_grad():
            actual = dense_forward(x0, base, cfg) - tp_forward(x0, base, cfg, reduce_output=False)
            n = rms_norm(x0, base["norm"], cfg.eps)
            partials = [attend_and_project(n, s, cfg) for s in shard_params(base, cfg)]
        got = fingerprint(x0.clone(), {k: v.clone() for k, v in base.items()}, cfg)
        got = tensor(got, "your fingerprint").detach()
        expect_shape(got, actual.shape, f"for {shape_text(cfg)} your fingerprint")
        # Both sides add up to world_size + 1 terms of size <= scale, each with float32 rounding.
        scale = (x0.abs() + sum(p.abs() for p in partials)).max().item()
        bound = 4 * (cfg.world_size + 1) * torch.finfo(cfg.torch_dtype).eps * scale
        hints = [(actual, None),
                 (partials[0], "that is rank 0's own partial, the one the buggy block keeps"),
                 (sum(partials), "that is the whole branch, every rank's partial"),
                 (-actual, "the sign is flipped: dense minus the buggy output")]
        hint = next((text for t, text in hints if bool((got - t).abs().max() <= bound)),
                    f"it is off by up to {(got - actual).abs().max().item():.1e}")
        if hint is not None:
            raise Wrong(f"for seed {seed}, {shape_text(cfg)}: {hint}.")
    return (f"your fingerprint equals dense − (block without g) up to float32 rounding for "
            f"{coverage()}: the forward error of a missing g is exactly what rank 0 misses.")


@exercise("predict missing f's signature", 9)
def check_missing_f_signature(predict) -> str:
    """Check ``predict() -> set``: the measures (``tpattn.MEASURES``) that fail without f."""
    return grade_prediction(predict, MISSING_INPUT_GRAD_REDUCE)


@exercise("which parameters a missing f hits", 9)
def check_missing_f_parameters(predict) -> str:
    """Check ``predict() -> set``: the parameters with wrong gradients without f."""
    return grade_prediction(predict, MISSING_INPUT_GRAD_REDUCE, hits=True)


# --- chapter 10 -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _real_runs() -> tuple[dict, ...]:
    return tuple(run(seed, mode, cfg, "ranks") for cfg in CHECKED_CONFIGS
                 for seed in CHECKED_SEEDS for mode in MODES)


def _synthetic(fails: tuple) -> dict:
    """A made-up result: ``fails`` at exactly TOLERANCE, the other measures at half of it."""
    measures = {m: TOLERANCE if m in fails else 0.5 * TOLERANCE for m in MEASURES}
    return {"seed": 0, "mode": "unknown", **measures, "passed": not fails}


#: Signatures no mode of the package produces (the checkers' "unknown" cases).
_UNKNOWN_SIGNATURES = (("loss_abs_diff",), ("post_step_weight_max_abs_diff",),
                       ("forward_max_abs_diff",), ("input_grad_max_abs_diff",), MEASURES[3:])


def _result_text(result: dict) -> str:
    if result["mode"] != "unknown":
        return f"seed {result['seed']}, {result['mode']}"
    fails = failing(result)
    return (f"a made-up result where {', '.join(fails) or 'nothing'} "
            f"{'is' if len(fails) == 1 else 'are'} at TOLERANCE and the rest below")


def _signatures() -> dict[str, set]:
    """Each mode's failing measures, the same on every checked run (a test asserts it)."""
    return {r["mode"]: set(failing(r)) for r in _real_runs()}


@exercise("two measures that tell the modes apart", 10)
def check_separating_measures(pick) -> str:
    """Check ``pick() -> set``: two measures whose pass/fail tells the three modes apart."""
    chosen = as_names(pick(), MEASURES, "measure")
    signatures = _signatures()
    if len(chosen) < 2:
        raise Wrong(f"{len(chosen)} measure{'s' if len(chosen) != 1 else ''} can pass or fail "
                    f"in at most 2 ways, and there are 3 modes to tell apart; pick two.")
    pair = next(((a, b) for a, b in combinations(MODES, 2)
                 if all((m in signatures[a]) == (m in signatures[b]) for m in chosen)), None)
    if pair:
        raise Wrong(f"{pair[0]} and {pair[1]} pass and fail alike on "
                    f"{', '.join(m for m in MEASURES if m in chosen)}: one measure must fail "
                    f"without f (the backward pass), the other only without g (the forward pass).")
    if len(chosen) > 2:
        raise Wrong(f"these {len(chosen)} measures tell the modes apart, but two suffice: keep "
                    f"one that fails only without g and one that fails without either.")
    return (f"right: {' and '.join(m for m in MEASURES if m in chosen)} tell the three modes "
            f"apart on all {len(_real_runs())} checked runs (every mode, 3 seeds, 3 shapes).")


@exercise("diagnose a signature", 10)
def check_diagnose(diagnose) -> str:
    """Check ``diagnose(result) -> str | None``: from a ``tpattn.run`` dict's measures, the mode
    (of ``MODES``) that leaves its signature, or None for one no mode leaves."""
    real = [dict(r) for r in _real_runs()]
    mode_of = {tuple(failing(r)): r["mode"] for r in real}  # one signature per mode, tested
    results = real + [_synthetic(s) for s in _UNKNOWN_SIGNATURES if s not in mode_of]
    for result in results:
        got = diagnose({k: v for k, v in result.items() if k != "mode"})
        want = mode_of.get(tuple(failing(result)))
        if got == want:
            continue
        if got is not None and got not in MODES:
            raise Wrong(f"your function returned {got!r}; return one of "
                        f"{', '.join(MODES)}, or None for a signature no mode leaves.")
        raise Wrong(f"for {_result_text(result)} (failing: "
                    f"{', '.join(failing(result)) or 'nothing'}) you said {got}; "
                    + (f"the run came from {want}." if want else
                       "no mode leaves that signature, so the answer is None."))
    return (f"right on {len(results)} results: every real run ({len(real)}: every mode, "
            f"{len(CHECKED_SEEDS)} seeds, {len(CHECKED_CONFIGS)} shapes) "
            f"and every made-up signature that no mode leaves.")
