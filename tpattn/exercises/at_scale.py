"""Part IV (chapters 14-15): the rounding bound, rounding or a bug, sharding a fused QKV weight."""
from __future__ import annotations

import functools
import math

import torch

from tpattn.block.params import clone_trainable, init_params, rank_head_slices
from tpattn.bugs.modes import resolve, run
from tpattn.check.at_scale import llama3_8b_attention
from tpattn.check.core import MEASURES, MODES, PARAM_SEED_OFFSET
from tpattn.check.tolerance import (ACCUMULATOR, LATER_STAGES, UNIT_ROUNDOFF, fan_in,
                                    relative_bound)
from tpattn.config import Config
from tpattn.exercises.graders import (CHECKED_CONFIGS, CHECKED_SEEDS, Wrong, exercise,
                                      expect_shape, head_of, number, rank_dicts, shape_text,
                                      tensor)
from tpattn.exercises.splitting import check_shard_params

# --- chapter 14 -----------------------------------------------------------------------------

#: Shapes of the bound exercise, up to Llama-3-8B's attention.
_BOUND_CONFIGS = (Config(), Config(dtype="float64"), Config(dtype="bfloat16"),
                  Config(seq=7, batch=3, hidden=32, query_heads=8, kv_heads=2, world_size=4),
                  llama3_8b_attention(), llama3_8b_attention(dtype="bfloat16"),
                  llama3_8b_attention(seq=512, world_size=2))


def _bound_variants(cfg: Config) -> dict[str, float]:
    """The bound with one ingredient wrong, each keyed by what it misses."""
    u, n = UNIT_ROUNDOFF[cfg.dtype], fan_in(cfg)
    u_acc = UNIT_ROUNDOFF[ACCUMULATOR[cfg.dtype]]
    w, later = cfg.world_size, LATER_STAGES
    return {
        "the long sums accumulate in the accumulator's precision (float32 for bfloat16), "
        "so their term uses u_acc, not the stored dtype's u":
            u * math.sqrt(n) + u * (w + later),
        "the later stages and the W-term of the sum over ranks round in the stored dtype: "
        "u, not u_acc": u_acc * math.sqrt(n) + u_acc * (w + later),
        "rounding errors of a long sum grow like sqrt(n), not n":
            u_acc * n + u * (w + later),
        "the sum over W ranks' partials adds W roundings": u_acc * math.sqrt(n) + u * later,
        f"the {later} elementwise stages after the reductions each round once":
            u_acc * math.sqrt(n) + u * w,
        "n is the longest dot product of the step: max(hidden, (Hq + 2 Hkv) D, S·B), not "
        "hidden alone": u_acc * math.sqrt(cfg.hidden) + u * (w + later),
    }


@exercise("the tolerance bound", 14)
def check_relative_bound(bound) -> str:
    """Check ``bound(cfg) -> float``: the relative bound ``rho`` of ``tpattn.check.tolerance``."""
    for cfg in _BOUND_CONFIGS:
        got = number(bound(cfg), (int, float), "your bound should be a float, but it is {}.")
        want = relative_bound(cfg)
        if abs(got - want) <= 1e-9 * want:
            continue
        why = next((text for text, value in _bound_variants(cfg).items()
                    if abs(got - value) <= 1e-9 * value), None)
        ratio = got / want if want else float("inf")
        raise Wrong(f"for {shape_text(cfg)}, your bound is {ratio:.3g} times the package's"
                    + (f": {why}." if why else "."))
    return (f"right for all {len(_BOUND_CONFIGS)} shapes, float32, float64 and bfloat16 among "
            f"them, up to Llama-3-8B's attention: rho = u_acc sqrt(n) + u (W + 4).")


CLASSIFY_CONFIGS = (Config(), Config(dtype="float64"), Config(dtype="bfloat16"),
                    Config(query_heads=8, kv_heads=4, world_size=4, dtype="bfloat16"))


@functools.lru_cache(maxsize=None)
def _auto_runs() -> tuple[tuple[Config, dict], ...]:
    return tuple((cfg, run(seed, mode, cfg, tolerance="auto"))
                 for cfg, seed in zip(CLASSIFY_CONFIGS, CHECKED_SEEDS + CHECKED_SEEDS)
                 for mode in MODES)


@exercise("rounding or a bug", 14)
def check_classify(classify) -> str:
    """Check ``classify(result) -> str``: ``"rounding"`` if a ``tpattn.run(tolerance="auto")``
    dict's measures are within its ``"bounds"``, else ``"bug"``."""
    hidden = ("passed", "mode", "verdict", "reason", "floors", "amplification")
    runs = [(cfg, dict(r, bounds=dict(r["bounds"]))) for cfg, r in _auto_runs()]
    for cfg, result in runs:
        want = "rounding" if resolve(result["mode"]).is_correct else "bug"
        got = classify({k: v for k, v in result.items() if k not in hidden})
        if got not in ("rounding", "bug"):
            raise Wrong(f"your function should return 'rounding' or 'bug', but it gave {got!r}.")
        if got == want:
            continue
        over = [m for m in MEASURES if result[m] > result["bounds"][m]]
        if want == "rounding":
            raise Wrong(f"correct TP (seed {result['seed']}, {cfg.dtype}) is rounding: every "
                        f"measure is within its bound, even where it is above the fixture's "
                        f"fixed 1e-6 — the bound scales with the dtype and the size.")
        raise Wrong(f"{result['mode']} (seed {result['seed']}, {cfg.dtype}) is a bug: "
                    f"{', '.join(over)} exceed{'s' if len(over) == 1 else ''} "
                    f"{'its bound' if len(over) == 1 else 'their bounds'}; any one measure over "
                    f"its bound is enough.")
    return (f"right on {len(runs)} runs: every mode, {len(CHECKED_SEEDS)} seeds, float32, float64 "
            f"and bfloat16 — correct TP within its bounds, every bug over at least one.")


# --- chapter 15 -----------------------------------------------------------------------------

#: Shapes of the fused-QKV exercises: two KV groups per rank among them.
FUSED_CONFIGS = CHECKED_CONFIGS + (Config(query_heads=8, kv_heads=4),)
_KINDS = {"wq": "query head", "wk": "key head", "wv": "value head"}


def _block_source(block: torch.Tensor, params: dict, d: int) -> str:
    """Which dense head ``block`` (``d`` rows) is, in words: 'query head 2', or '' if none."""
    for name, what in _KINDS.items():
        h = head_of(block.detach(), params[name].detach(), d)
        if h is not None:
            return f"{what} {h}"
    return ""


def _grade_fused_rows(mine, base: dict, cfg: Config, rank: int, layout: str) -> None:
    """``Wrong`` unless every head in ``wq``, ``wk``, ``wv`` is a dense head of its kind."""
    d = cfg.head_dim
    if not isinstance(mine, dict) or any(k not in mine for k in _KINDS):
        raise Wrong(f"rank {rank}'s shard should be a dict with the keys wq, wk, wv.")
    for name in _KINDS:
        heads = cfg.local_query_heads if name == "wq" else cfg.local_kv_heads
        t = tensor(mine[name], f"rank {rank}'s {name}")
        expect_shape(t, [heads * d, cfg.hidden], f"for {shape_text(cfg)}, rank {rank}'s {name}")
        for i in range(heads):
            source = _block_source(t[i * d:(i + 1) * d], base, d)
            if not source.startswith(_KINDS[name]):
                raise Wrong(f"for {shape_text(cfg)}, rank {rank}'s {name} rows "
                            f"{i * d}..{(i + 1) * d - 1} are {source or 'no whole head'} of the "
                            f"{layout} weight, not a {_KINDS[name]}: read the fused rows by the "
                            f"layout, then cut by heads.")


def _grade_fused(shard, fuse, layout: str) -> str:
    """Grade ``shard(fuse(params, cfg), cfg)``: every rank's heads, then chapter 6's checks."""
    for cfg in FUSED_CONFIGS:
        base = clone_trainable(init_params(cfg, 11 + PARAM_SEED_OFFSET))
        for rank, mine in enumerate(rank_dicts(shard(fuse(base, cfg), cfg), cfg)):
            _grade_fused_rows(mine, base, cfg, rank, layout)

    def shard_fn(params, cfg):
        return [{"norm": params["norm"], **{k: mine[k] for k in _KINDS},
                 "wo": params["wo"][:, rank_head_slices(cfg, r)[0]]}
                for r, mine in enumerate(shard(fuse(params, cfg), cfg))]

    try:
        check_shard_params.__wrapped__(shard_fn)
    except Wrong as e:
        raise Wrong(f"with the wo columns of chapter 6, {e}") from None
    return (f"every rank's rows are its own heads on {len(FUSED_CONFIGS)} shapes (two KV "
            f"groups per rank among them), gradients reach the dense parameters, and with "
            f"chapter 6's wo columns the sharded block passes all five measures for "
            f"{len(CHECKED_SEEDS)} seeds × {len(CHECKED_CONFIGS)} shapes.")


@exercise("shard a concatenated [Wq; Wk; Wv] weight", 15)
def check_shard_concat_qkv(shard) -> str:
    """Check ``shard(w, cfg) -> list[dict]``: every rank's rows of ``w = [Wq; Wk; Wv]``."""
    return _grade_fused(shard, lambda p, cfg: torch.cat([p["wq"], p["wk"], p["wv"]]),
                        "concatenated")


@exercise("shard Megatron's interleaved QKV weight", 15)
def check_shard_fused_qkv(shard) -> str:
    """Check ``shard(w, cfg) -> list[dict]``: the same from ``interop.fuse_qkv``'s weight."""
    from tpattn.interop import fuse_qkv
    return _grade_fused(shard, lambda p, cfg: fuse_qkv(p["wq"], p["wk"], p["wv"], cfg),
                        "interleaved")
