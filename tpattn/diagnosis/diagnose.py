"""``diagnose(observations)``: which known TP bugs explain what a run shows — or none. A run's
``DEVIATIONS`` (what a correct run would not show) are matched against every cause's
``Fingerprint``; the answer is the smallest set of causes that explains them all (a tie when
several), or ``NO_KNOWN_CAUSE``. ``TIERS``: what each tier of evidence holds."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Callable

from tpattn.bugs.modes import run
from tpattn.bugs.zoo import REGISTRY, resolve, runnable_modes
from tpattn.check.measures import MEASURES, TOLERANCE
from tpattn.config import Config
from tpattn.parallel.engine import REPLICATED

__all__ = ["diagnose", "features", "deviations", "DEVIATIONS", "FINGERPRINTS", "Fingerprint",
           "register_fingerprint", "NO_KNOWN_CAUSE", "AGREE_REL", "TIERS", "lowest_tier",
           "UNREGISTERED_FORWARD", "FORWARD_ONLY", "MAX_CAUSES", "OUTSIDE_REL", "evidence_of",
           "explanations", "fits"]

NO_KNOWN_CAUSE = "no known cause"
#: In the tie of a cause whose only evidence is "a partial itself changed" (``FORWARD_ONLY``).
UNREGISTERED_FORWARD = "another error of the sharded forward (not in the registry)"
#: Two observables agree within this relative distance (float32 rounding: ~1e-7).
AGREE_REL = 1e-4
#: The most causes one explanation may hold.
MAX_CAUSES = 3
#: ``output_outside_partials`` above this is a changed partial (rounding: ~1e-5; bugs >= 0.4).
OUTSIDE_REL = 1e-2


def _close(a: float, b: float, rel: float = AGREE_REL) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


def _spread(values: list[float]) -> bool:
    return any(not _close(v, values[0]) for v in values)


#: Ledger counts: name -> which entries it counts (each also counted in the plan, ``_plan``).
_LEDGER_COUNTS: dict[str, Callable[[dict], bool]] = {
    "fwd": lambda e: e["phase"] == "forward" and _reduction(e),
    "bwd": lambda e: e["phase"] == "backward" and _reduction(e),
    "bwd_avg": lambda e: e["phase"] == "backward" and e["group"] == "tp" and _op(e) == "avg",
    "after_bwd": lambda e: e["phase"] == "after backward",
    "after_bwd_avg": lambda e: e["phase"] == "after backward" and _op(e) == "avg",
    "kv_reduces": lambda e: e["group"] == "kv_replicas",
    "world_loss": lambda e: e["group"] == "world",
    "dp_loss": lambda e: e["group"] == "dp" and e["phase"] == "step",
    "self_grad": lambda e: e["group"] == "self",
    "sp_dp": lambda e: e["group"] == "dp" and e["phase"] in ("forward", "backward"),
}


def _op(entry: dict) -> str | None:
    return entry.get("op", "sum")


def _reduction(entry: dict) -> bool:
    """A reduction (``op`` not None) over the TP group (or DP in its place)."""
    return entry["group"] in ("tp", "dp") and _op(entry) is not None


def _ledger_counts(ledger: list[dict], plan: list[dict]) -> dict:
    """Every ``_LEDGER_COUNTS`` count of the ledger and of the plan (``_plan`` keys)."""
    return {name + suffix: sum(map(test, entries)) for name, test in _LEDGER_COUNTS.items()
            for suffix, entries in (("", ledger), ("_plan", plan))}


def _norm_totals(obs: dict) -> tuple[float, float]:
    """The global gradient norm, replicated parameters counted ``(once, per_rank)``."""
    once = every = 0.0  # the logged norm is one TP group's: the first (on a mesh, replica 0)
    for rank, norms in enumerate(obs["rank_grad_norms"][:obs["setup"]["world_size"]]):
        for name, n in norms.items():
            every += n * n
            once += n * n if name not in REPLICATED or rank == 0 else 0.0
    return once ** 0.5, every ** 0.5


def _shard_checks(obs: dict) -> dict:
    """``shards_ok`` per parameter (every rank's ``shard_checksums`` within 1e-5 of
    ``shard_scale``), and which ranks hold wrong Q/K/V numbers: rank 0 only right, off within
    each rank (Q+K+V sum right), rank 0's queries right but not its keys or values."""
    d, scale = obs["shard_checksums"], obs["shard_scale"]
    ok = {k: [abs(x) <= 1e-5 * max(scale[k], 1.0) for x in v] for k, v in d.items()}
    qkv = ("wq", "wk", "wv")
    off = [not all(ok[k][r] for k in qkv) for r in range(len(ok["wq"]))]
    tol = 1e-5 * max(max(scale[k] for k in qkv), 1.0)
    return {"shards_ok": {k: all(v) for k, v in ok.items()},
            "qkv_rank0_only": len(off) >= 2 and not off[0] and all(off[1:]),
            "qkv_within_rank": any(off) and all(abs(sum(d[k][r] for k in qkv)) <= tol
                                                for r in range(len(off))),
            "qkv_rank0_queries": ok["wq"][0] and not (ok["wk"][0] and ok["wv"][0])}


def features(obs: dict) -> dict:
    """The yes/no facts and counts the deviations are read from, computed from ``obs``."""
    setup = obs["setup"]
    w = setup["world_size"]
    ledger, plan = obs["ledger"], obs["planned_ledger"]
    agree_1 = {k: len(set(v)) == 1 for k, v in obs["replica_checksums"]["after_1"].items()}
    f = {
        "world_size": w,
        "bias": setup.get("bias", False), "fused_qkv": setup.get("fused_qkv", False),
        "grad_clip": setup.get("grad_clip", False),
        "kv_per_rank": setup["kv_heads"] // w if setup["kv_heads"] >= w else 0,
        "gqa": setup["query_heads"] > setup["kv_heads"],
        "losses_agree": not _spread(obs["rank_losses"]),
        "losses_per_rank": setup.get("logged_loss", "per_rank") == "per_rank",
        "batches_agree": all(len(set(obs["batch_checksums"][i:i + w])) == 1  # per TP group
                             for i in range(0, len(obs["batch_checksums"]), w)),
        **_shard_checks(obs),
        # replicas get the same all-reduced gradient and the same update: the same bits
        "agree_1": agree_1, "replicas_agree_1": all(agree_1.values()),
        "sequence_parallel": setup.get("sequence_parallel", False),
        "kv_replicated": setup["kv_heads"] < w,
        "replicas_agree_k": all(len(set(v)) == 1
                                for v in obs["replica_checksums"]["after_k"].values()),
        **_ledger_counts(ledger, plan),
        "dropout": setup.get("dropout", 0.0) > 0, "qk_norm": setup.get("qk_norm", False),
        # the ranks' default RNG states when the step starts (observed with dropout only)
        "rng_states_agree": len(set(obs.get("rng_state_checksums", [0.0]))) == 1,
        "ledger_as_planned": ledger == plan,
        "mesh": setup.get("data_parallel", 1) > 1, "logged_loss_is": _logged_loss_is(obs),
    }
    once, every = _norm_totals(obs) if "rank_grad_norms" in obs else (None, None)
    logged = obs["logged_grad_norm"]
    f["logged_norm_is"] = ("unknown" if once is None else "once" if _close(logged, once)
                           else "per rank" if _close(logged, every) else "neither")
    f["has_reference"] = obs.get("reference") is not None
    if f["has_reference"]:
        f.update(_reference_features(obs))
    return f


def _reference_features(obs: dict) -> dict:
    """The facts read against the known-good run (``obs["reference"]``)."""
    ref, ratio, w = obs["reference"], obs["grad_norm_ratio"], obs["setup"]["world_size"]
    logged = obs["logged_grad_norm"]
    return {
        "loss_matches": _close(obs["rank_losses"][0], ref["rank_losses"][0]),
        "curve_matches": all(_close(a, b) for a, b in zip(obs["loss_curve"], ref["loss_curve"])),
        "grads_match": {k: _close(r, 1.0) for k, r in ratio.items()},
        "norm_ratio_is": {"1/W": _close(ratio["norm"], 1 / w), "W": _close(ratio["norm"], w),
                          "1": _close(ratio["norm"], 1.0)},
        "logged_norm_high": logged > ref["logged_grad_norm"] * (1 + AGREE_REL),
        "logged_norm_matches": _close(logged, ref["logged_grad_norm"]),
        "bias_shift_along_bias": obs.get("bias_grad_shift_cosine", 0.0) > 1 - 1e-3,
        "output_outside_partials": obs.get("output_outside_partials", 0.0) > OUTSIDE_REL,
    }


def _logged_loss_is(obs: dict) -> str:
    """On a TP x DP mesh, what the logged loss is of the ranks' shares: "total", "W times",
    "own share" or "neither" ("total" off a mesh)."""
    setup = obs["setup"]
    w, mesh = setup["world_size"], setup.get("data_parallel", 1)
    if mesh == 1:
        return "total"
    shares, logged = obs["loss_shares"], obs["rank_losses"][0]
    sp = setup.get("sequence_parallel", False)
    own = sum(shares[:w]) if sp else shares[0]
    total = sum(shares) if sp else sum(shares[d * w] for d in range(mesh))
    return ("total" if _close(logged, total) else "W times" if _close(logged, w * total)
            else "own share" if _close(logged, own) else "neither")


def _fewer(count: str) -> Callable[[dict], bool]:
    return lambda f: f[count] < f[count + "_plan"]


def _more(count: str) -> Callable[[dict], bool]:
    return lambda f: f[count] > f[count + "_plan"]


def _drift(*names: str) -> Callable[[dict], bool]:
    """The test "a replica checksum whose key starts with one of ``names`` differs after
    one step"."""
    return lambda f: not all(ok for k, ok in f["agree_1"].items() if k.startswith(names))


def _sharded_grads_off(f: dict) -> bool:
    return not all(ok for k, ok in f["grads_match"].items() if k not in ("norm", "bias"))


#: What a run can show that a correct one would not: name -> (text, tier, test(features)).
#: A tier-2 deviation compares with the known-good run.
DEVIATIONS: dict[str, tuple[str, int, Callable[[dict], bool]]] = {
    "fwd_short": ("forward ledger: fewer reductions than the plan (g missing)", 1, _fewer("fwd")),
    "fwd_extra": ("forward ledger: more reductions than the plan (an extra g)", 1, _more("fwd")),
    "bwd_short": ("backward ledger: fewer reductions than the plan (f missing)", 1, _fewer("bwd")),
    "bwd_extra": ("backward ledger: more reductions than the plan (an extra f)", 1, _more("bwd")),
    "bwd_avg": ("backward ledger: an all-reduce with op avg where the plan has sum", 1,
                _more("bwd_avg")),
    "after_bwd_short": ("after backward: fewer all-reduces than the plan (the norm gradient's)", 1,
                        _fewer("after_bwd")),
    "after_bwd_avg": ("after backward: the norm gradient's all-reduce has op avg where the plan "
                      "has sum", 1, _more("after_bwd_avg")),
    "kv_short": ("backward: fewer all-reduces over the KV replica groups than the plan", 1,
                 _fewer("kv_reduces")),
    "batches": ("the ranks' batch checksums differ", 1, lambda f: not f["batches_agree"]),
    "qkv_shards": ("ranks hold Q/K/V numbers that are not their checkpoint slices", 1,
                   lambda f: not all(f["shards_ok"][k] for k in ("wq", "wk", "wv"))),
    "qkv_rank0_only": ("rank 0 holds its Q/K/V slices, every other rank other numbers (the ranks "
                       "narrowed one rank's rows)", 1, lambda f: f["qkv_rank0_only"]),
    "qkv_within_rank": ("each rank's Q, K and V checksums are off but their sum is right (its own "
                        "rows under the wrong names)", 1, lambda f: f["qkv_within_rank"]),
    "qkv_rank0_queries": ("rank 0's query rows are its slice, its key/value rows are not (a "
                          "contiguous cut of [Wq; Wk; Wv])", 1, lambda f: f["qkv_rank0_queries"]),
    "wo_shards": ("ranks hold output-projection numbers that are not their slices", 1,
                  lambda f: not f["shards_ok"]["wo"]),
    "losses_disagree": ("the ranks' step-0 losses disagree", 1,
                        lambda f: f["losses_per_rank"] and not f["losses_agree"]),
    "norm_replicas": ("the replicated norm weight differs across ranks after one step", 1,
                      _drift("norm")),
    "bias_replicas": ("the replicated bias differs across ranks after one step", 1,
                      _drift("bias")),
    "kv_replicas": ("wk/wv differ across the ranks of a KV replica group after one step", 1,
                    _drift("wk", "wv")),
    "rng_states": ("the ranks' default RNG states differ when the step starts (dropout masks "
                   "outside the sharded region differ)", 1, lambda f: not f["rng_states_agree"]),
    "qk_norm_replicas": ("the replicated q/k-norm weights differ across ranks after one step", 1,
                         _drift("q_norm", "k_norm")),
    "late_drift": ("replicas identical after one step differ after the last", 1,
                   lambda f: f["replicas_agree_1"] and not f["replicas_agree_k"]),
    "norm_counts_replicas": ("the logged gradient norm counts the replicated gradients on every "
                             "rank (from the per-rank gradient norms)", 1,
                             lambda f: f["logged_norm_is"] == "per rank"),
    "norm_unexplained": ("the logged gradient norm is not the per-rank gradient norms' total", 1,
                         lambda f: f["logged_norm_is"] == "neither"),
    "loss_over_world": ("the ledger's logged-loss all-reduce runs over the whole mesh (group "
                        "world) where the plan has the DP group", 1, _more("world_loss")),
    "loss_not_reduced": ("the ledger has no logged-loss all-reduce where the plan has one over "
                         "the DP group", 1, lambda f: f["dp_loss"] + f["world_loss"]
                         < f["dp_loss_plan"] + f["world_loss_plan"]),
    "logged_loss_w_times": ("the logged loss is W times the sum of the ranks' loss shares over "
                            "the DP replicas", 1,
                            lambda f: f["mesh"] and f["logged_loss_is"] == "W times"),
    "logged_loss_own_share": ("the logged loss is rank 0's replica's own share, not the sum over "
                              "the DP replicas", 1,
                              lambda f: f["mesh"] and f["logged_loss_is"] == "own share"),
    "dp_grad_self": ("the ledger's DP gradient all-reduce runs over a group of one rank (group "
                     "self) where the plan has the DP group", 1, _more("self_grad")),
    "dp_replicas": ("a parameter differs across the DP replicas after one step", 1, _drift("dp ")),
    "sp_over_dp": ("the sequence all-gather/reduce-scatter runs over the DP group where the plan "
                   "has the TP group", 1, _more("sp_dp")),
    "loss_off": ("the step-0 loss differs from the good run's (the forward is wrong)", 2,
                 lambda f: not f["loss_matches"]),
    "grads_off": ("the sharded weights' gradient norms differ from the good run's", 2,
                  _sharded_grads_off),
    "norm_grad_w": ("the norm weight's gradient norm is W times the good run's", 2,
                    lambda f: f["norm_ratio_is"]["W"]),
    "norm_grad_1w": ("the norm weight's gradient norm is 1/W times the good run's", 2,
                     lambda f: f["norm_ratio_is"]["1/W"]),
    "norm_grad_off": ("the norm weight's gradient norm differs from the good run's (not W, not "
                      "1/W)", 2, lambda f: not any(f["norm_ratio_is"].values())),
    "outside_partials": ("the output's change from the good run's is no combination of the good "
                         "run's rank partials and bias (a partial itself changed)", 2,
                         lambda f: f["output_outside_partials"]),
    "bias_shift": ("the bias gradient moved along the bias itself (an extra copy of b in the "
                   "output)", 2, lambda f: f["bias"] and f["bias_shift_along_bias"]),
    "curve_off": ("the loss curve leaves the good run's while step 0's loss and gradients match "
                  "it", 2, lambda f: not f["curve_matches"] and f["loss_matches"]
                  and all(f["grads_match"].values())),
}


def deviations(f: dict) -> list[str]:
    """The ``DEVIATIONS`` that features ``f`` show (tier 2 only with a known-good run)."""
    return [name for name, (_, tier, test) in DEVIATIONS.items()
            if (tier == 1 or f["has_reference"]) and test(f)]


@dataclass(frozen=True)
class Fingerprint:
    """What one cause leaves: deviations it always ``shows`` (``alone``: unless another
    ``forward``-changing cause is present), all it ``explains``, the setups it ``allows``,
    and the test that would ``confirm`` it."""

    shows: tuple[str, ...]
    explains: frozenset
    confirm: str
    allows: Callable[[dict], bool] = lambda f: f["world_size"] >= 2
    alone: tuple[str, ...] = ()
    forward: bool = False


#: What a wrong forward moves downstream: the loss and every gradient.
_FORWARD_EFFECTS = ("loss_off", "grads_off", "norm_grad_w", "norm_grad_1w", "norm_grad_off")
#: What a wrong norm-weight gradient (dn, or its reduce) moves at step 0.
_NORM_GRAD = ("norm_grad_w", "norm_grad_1w", "norm_grad_off")


def _fp(shows, explains, confirm, allows=None, alone=(), forward=False) -> Fingerprint:
    extra = _FORWARD_EFFECTS if forward else ()
    return Fingerprint(tuple(shows), frozenset((*shows, *alone, *explains, *extra)), confirm,
                       allows or _tp_with(), tuple(alone), forward)


def _tp_with(*flags: str, kv_per_rank: int = 0) -> Callable[[dict], bool]:
    """``allows``: two ranks or more, ``flags`` on, at least ``kv_per_rank`` KV heads a rank."""
    return lambda f: (f["world_size"] >= 2 and all(f[flag] for flag in flags)
                      and (not kv_per_rank or f["kv_per_rank"] >= kv_per_rank))


FINGERPRINTS: dict[str, Fingerprint] = {
    "missing_output_reduce": _fp(
        ["fwd_short"], ["losses_disagree", "norm_replicas", "bias_replicas"],
        "all-reduce the output partials: every rank's loss should become the same", forward=True),
    "output_reduced_twice": _fp(
        ["fwd_extra"], [], "remove one all-reduce: the block's output drops by the factor W",
        forward=True),
    "missing_input_grad_reduce": _fp(
        ["bwd_short"], ["norm_replicas", *_NORM_GRAD],
        "all-reduce dn in backward: the norm replicas stay identical"),
    "input_grad_reduced_twice": _fp(
        ["bwd_extra"], _NORM_GRAD, "drop the second all-reduce: the norm gradient falls by "
        "exactly W"),
    "input_grad_reduce_averaged": _fp(
        ["bwd_avg"], _NORM_GRAD, "reduce dn with SUM instead of AVG: the norm gradient grows "
        "by exactly W"),
    "grad_norm_counts_replicas": _fp(
        ["norm_counts_replicas"], ["curve_off"],
        "count replicated parameters on one rank: the logged norm equals the TP = 1 norm",
        allows=_tp_with("grad_clip")),
    "row_bias_on_every_rank": _fp(
        ["loss_off"], [], "add the bias after the all-reduce: the output drops by exactly "
        "(W-1)*b", allows=_tp_with("bias"), alone=["bias_shift"], forward=True),
    "fused_qkv_naive_split": _fp(
        ["qkv_shards", "qkv_rank0_queries"], ["outside_partials"],
        "split Wq, Wk, Wv by heads: each rank's Q/K/V checksums match the checkpoint's slices",
        allows=_tp_with("fused_qkv"), forward=True),
    "qkv_loaded_from_rank0": _fp(
        ["qkv_shards", "qkv_rank0_only"], ["outside_partials"],
        "pass each rank's tp_rank to the loader (or read it from the process group): every "
        "rank's Q/K/V checksums match its checkpoint slice",
        allows=_tp_with("fused_qkv"), forward=True),
    "grouped_qkv_read_as_plain": _fp(
        ["qkv_shards", "qkv_within_rank"], ["outside_partials"],
        "split each rank's rows per KV group ([q x g; k; v]): its Q, K and V checksums then "
        "match; or rerun with one group per rank, where both readings agree",
        allows=_tp_with("fused_qkv", kv_per_rank=2), forward=True),
    "repeat_kv_tiled": _fp(
        ["loss_off", "outside_partials"], [], "rerun with one KV head per rank (TP = "
        "kv_heads): a tiled repeat_kv is then exact",
        allows=_tp_with("gqa", kv_per_rank=2), forward=True),
    "inputs_not_replicated": _fp(
        ["batches"], ["losses_disagree", "norm_replicas", "bias_replicas", "kv_replicas",
                      "outside_partials"],
        "broadcast the batch from TP rank 0: the batch checksums and losses agree", forward=True),
    "missing_norm_grad_reduce": _fp(
        ["after_bwd_short"], ["norm_replicas", *_NORM_GRAD],
        "all-reduce the norm weight's gradient over the TP group: the norm replicas stay "
        "identical", allows=_tp_with("sequence_parallel")),
    "norm_grad_averaged": _fp(
        ["after_bwd_avg"], _NORM_GRAD, "reduce the norm gradient with SUM, not AVG: it grows "
        "by exactly W", allows=_tp_with("sequence_parallel")),
    "missing_kv_grad_reduce": _fp(
        ["kv_short"], ["kv_replicas", "grads_off"],
        "all-reduce wk/wv gradients over each KV replica group: the replicas stay identical",
        allows=_tp_with("kv_replicated")),
    "dropout_rng_desync": _fp(
        ["rng_states"], ["losses_disagree", "outside_partials"],
        "re-sync the default RNG state over the TP group before the step (or give the data "
        "loader its own generator): the RNG checksums and the ranks' losses agree",
        allows=_tp_with("dropout"), forward=True),
    "qk_norm_grad_not_reduced": _fp(
        ["after_bwd_short", "qk_norm_replicas"], ["grads_off"],
        "all-reduce the q/k-norm weights' gradients over the TP group after backward: their "
        "replicas stay identical", allows=_tp_with("qk_norm")),
    "loss_reduced_over_world": _fp(
        ["loss_over_world", "logged_loss_w_times"], ["loss_off", "curve_off"],
        "all-reduce the loss metric over the DP submesh: the logged loss falls by exactly W",
        allows=lambda f: f["mesh"]),
    "loss_full_tensor_tp_only": _fp(
        ["loss_not_reduced", "logged_loss_own_share"], ["losses_disagree", "loss_off",
                                                        "curve_off"],
        "to_local() then all-reduce over the DP mesh: the replicas log the same loss, the "
        "sum of their shares", allows=lambda f: f["mesh"]),
    "dp_grad_group_of_one": _fp(
        ["dp_grad_self", "dp_replicas"], ["norm_replicas", "bias_replicas", "kv_replicas",
                                          "grads_off", "curve_off", *_NORM_GRAD],
        "all-reduce the gradients over the whole DP group: the replicas stay identical",
        allows=lambda f: f["mesh"]),
    "sp_gather_wrong_group": _fp(
        ["sp_over_dp"], ["outside_partials", "losses_disagree", "norm_replicas"],
        "build the column-parallel layers with the module's TP group: the gather's group "
        "becomes tp", allows=lambda f: f["mesh"] and f["sequence_parallel"], forward=True),
}

#: Causes whose only evidence is "a partial itself changed".
FORWARD_ONLY = {"repeat_kv_tiled"}


def register_fingerprint(cause: str, fingerprint: Fingerprint) -> None:
    """Add the fingerprint of a cause another module contributes."""
    if not isinstance(fingerprint, Fingerprint):
        raise ValueError(f"fingerprint must be a Fingerprint (got {type(fingerprint).__name__})")
    FINGERPRINTS[cause] = fingerprint


TIERS = {1: "the live job alone", 2: "the live job and a known-good run"}


def lowest_tier(cause: str) -> int | None:
    """The lowest tier of a deviation ``cause`` always shows (``None``: no fingerprint)."""
    if cause not in FINGERPRINTS:
        return None
    return min(DEVIATIONS[d][1] for d in FINGERPRINTS[cause].shows)


def evidence_of(cause: str) -> list[str]:
    """What ``cause`` always shows: ``["tier 1: <deviation text>", ...]``."""
    if cause not in FINGERPRINTS:
        return []
    fp = FINGERPRINTS[cause]
    return [f"tier {DEVIATIONS[d][1]}: {DEVIATIONS[d][0]}" for d in (*fp.shows, *fp.alone)]


def fits(causes: tuple[str, ...], seen: set[str]) -> bool:
    """Whether every cause of ``causes`` shows what it must in ``seen``."""
    for c in causes:
        fp = FINGERPRINTS[c]
        if not set(fp.shows) <= seen:
            return False
        masked = any(FINGERPRINTS[o].forward for o in causes if o != c)
        if not masked and not set(fp.alone) <= seen:
            return False
    return True


def explanations(seen: set[str], allowed: list[str]) -> list[tuple[str, ...]]:
    """The smallest sets (<= ``MAX_CAUSES``) of ``allowed`` causes that explain all of
    ``seen``, each showing its own."""
    usable = [c for c in allowed if set(FINGERPRINTS[c].shows) <= seen]
    for k in range(1, MAX_CAUSES + 1):
        found = [s for s in combinations(usable, k)
                 if seen <= set().union(*(FINGERPRINTS[c].explains for c in s))
                 and fits(s, seen)]
        if found:
            return found
    return []


def _blind_line(cannot_see: list[str], tier: int) -> list[str]:
    if tier != 1 or not cannot_see:
        return []
    return [f"tier 1 cannot see: {', '.join(cannot_see)} (their evidence compares with a "
            f"known-good run)"]


def _from_observations(obs: dict) -> list[dict]:
    f = features(obs)
    tier = 2 if f["has_reference"] else 1
    seen = deviations(f)
    allowed = [c for c, fp in FINGERPRINTS.items() if fp.allows(f)]
    cannot_see = [c for c in allowed if lowest_tier(c) > tier]
    sets = explanations(set(seen), allowed) if seen else []
    if not sets:
        unexplained = [DEVIATIONS[d][0] for d in seen
                       if not any(d in FINGERPRINTS[c].explains for c in allowed)]
        evidence = ([DEVIATIONS[d][0] for d in seen] or ["nothing deviates from a correct run"])
        if unexplained:
            evidence.append("no registry cause explains: " + "; ".join(unexplained))
        return _no_cause(evidence + _blind_line(cannot_see, tier), tier=tier,
                         cannot_see=cannot_see)
    # the most specific explanation first: the most deviations shown, then registry order
    sets.sort(key=lambda s: -sum(len(FINGERPRINTS[c].shows) + len(FINGERPRINTS[c].alone)
                                 for c in s))
    named = {c for s in sets for c in s}
    hidden = [c for c in allowed if c not in named and fits(sets[0] + (c,), set(seen))]
    unregistered = [UNREGISTERED_FORWARD] if (named | set(hidden)) & FORWARD_ONLY else []
    order = list(dict.fromkeys([c for s in sets for c in s] + hidden))
    found = []
    for cause in order:
        own = next((s for s in sets if cause in s), sets[0] + (cause,))
        fp = FINGERPRINTS[cause]
        evidence = [DEVIATIONS[d][0] for d in seen if d in fp.explains]
        if cause in hidden:
            evidence = [f"it would leave the same evidence: what it shows ("
                        + "; ".join(DEVIATIONS[d][0] for d in fp.shows)
                        + ") is explained already"]
        found.append({
            "cause": cause, "with": [c for c in own if c != cause], "score": len(evidence),
            "evidence": evidence + _blind_line(cannot_see, tier), "confirm": fp.confirm,
            "citation": REGISTRY[cause].citation if cause in REGISTRY else None,
            "tied_with": [c for c in order if c not in own] + unregistered,
            "tier": tier, "cannot_see": cannot_see})
    return found


def _no_cause(evidence: list[str], **more) -> list[dict]:
    """The one candidate ``NO_KNOWN_CAUSE`` with ``evidence`` (``more``: further keys)."""
    return [{"cause": NO_KNOWN_CAUSE, "with": [], "score": 0, "evidence": evidence,
             "confirm": "-", "citation": None, "tied_with": [], **more}]


def _from_five_measures(result: dict, cfg, signatures: dict | None, forward=None) -> list[dict]:
    cfg = cfg or Config()
    failing = tuple(m for m in MEASURES if result[m] >= TOLERANCE)
    if not failing:
        return _no_cause(["all five measures pass"])
    if signatures is None:
        signatures = {}
        for mode in runnable_modes():
            try:
                resolve(mode, cfg, strict=True)
                r = run(11, mode, cfg, "ranks")
            except ValueError:  # the shape does not meet the mode's needs
                continue
            signatures[mode] = tuple(m for m in MEASURES if r[m] >= TOLERANCE)
    matches = [m for m, sig in signatures.items() if sig == failing and sig]
    printed = {}  # cause -> does the run's error equal that cause's exact error?
    if forward is not None:
        from .fingerprints import EXACT_ERROR_TESTS as EXACT
        printed = {m: EXACT[m](forward, result["seed"], cfg) for m in matches if m in EXACT}
        matches = [m for m in matches if printed.get(m, True)]
    if not matches:
        return _no_cause(["failing measures: " + ", ".join(failing)] + [
            f"the signature of {m}, not its numerical fingerprint"
            for m, ok in printed.items() if not ok])
    found = [{"cause": m, "with": [], "score": len(failing) + printed.get(m, False),
              "evidence": ["failing measures match its signature: " + ", ".join(failing)]
              + (["its numerical fingerprint matches: the error is exactly what it leaves"]
                 if printed.get(m) else []),
              "confirm": "collect the observables (tpattn.observe) to tell the tied causes apart",
              "citation": REGISTRY[m].citation}
             for m in matches]
    found.sort(key=lambda c: -c["score"])
    for c in found:
        c["tied_with"] = [o["cause"] for o in found if o is not c and o["score"] == c["score"]]
    return found


def _tier0(candidates: list[dict], cfg) -> list[dict]:
    """Add to each registry candidate ``"tier0"``: ``typecheck``'s ``verdict``, ``where``
    and ``why`` at ``cfg`` (``"used": False`` and the rule where the shape cannot run it)."""
    from .typecheck import typecheck
    for c in candidates:
        if c["cause"] not in REGISTRY:
            continue
        try:
            t = typecheck(c["cause"], cfg)
        except ValueError as e:
            c["tier0"] = {"used": False, "why": str(e)}
            continue
        c["tier0"] = {"used": True, **{k: t[k] for k in ("verdict", "where", "why")}}
    return candidates


def diagnose(observations: dict, cfg=None, signatures: dict | None = None,
             forward=None, tier0: bool = False) -> list[dict]:
    """Candidate causes of what ``observations`` show, best first (at least one):
    ``{"cause", "with", "score", "evidence", "confirm", "citation", "tied_with", "tier",
    "cannot_see"}``; ``with``: the other causes of its explanation; ``tied_with``: causes that
    fit as well; ``cannot_see``: at tier 1, the causes only tier 2 sees. ``observations``:
    ``tpattn.observe``'s dict, or a ``tpattn.run`` result, whose failing
    measures are matched to each mode's ``signatures`` (measured at seed 11 on ``cfg`` when
    not given); ``forward`` (a TP ``forward(x, params, cfg)``) also tests a matching missing
    reduction's exact error (``fingerprints.EXACT_ERROR_TESTS``). ``tier0=True`` adds each
    registry candidate's ``typecheck`` verdict (``_tier0``)."""
    if not isinstance(observations, dict):
        raise ValueError(f"observations must be a dict from tpattn.observe or tpattn.run "
                         f"(got {type(observations).__name__})")
    if all(m in observations for m in MEASURES) and "setup" not in observations:
        found = _from_five_measures(observations, cfg, signatures, forward)
    else:
        missing = [k for k in ("setup", "rank_losses", "batch_checksums", "shard_checksums",
                               "replica_checksums", "ledger", "planned_ledger")
                   if k not in observations]
        if missing:
            raise ValueError(f"observations must have the keys of tpattn.observe (missing: "
                             f"{', '.join(missing)})")
        found = _from_observations(observations)
    if not tier0:
        return found
    if cfg is None:
        setup = observations.get("setup")
        cfg = Config() if setup is None else Config(
            world_size=setup["world_size"], query_heads=setup["query_heads"],
            kv_heads=setup["kv_heads"])
    return _tier0(found, cfg)
