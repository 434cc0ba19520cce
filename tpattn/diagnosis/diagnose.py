"""``diagnose(observations)``: which known TP bug explains what a run shows — or none.

Open-world: every cause of the registry has a *fingerprint*, a list of conditions on the
observables (``tpattn.observe``) that its mechanism implies. A cause is a candidate only when
all of its conditions hold; candidates are ranked by how many conditions they meet (the more
specific explanation first) and ties are named. When no fingerprint fits, the answer is
``"no known cause"``, with the deviations that were seen.

It also works from the five measures of ``tpattn.run`` (a dense model *was* available): the
set of measures that fail is matched against each mode's signature on the same shape.

Tiers (``TIERS``): what the diagnosis had. Tier 1 is the live job alone (the ranks' losses as
logged, checksums, the ledger against the plan); tier 2 adds a known-good run on the same
checkpoint and data (``observe(..., reference=True)``). A fingerprint condition that compares
with the good run makes its cause visible only at tier 2 (``lowest_tier``), unless it only
adds to evidence the live job already shows (then it is skipped at tier 1). At tier 1, when
nothing fits, the answer lists the causes tier 1 cannot see.

Each candidate: ``{"cause", "score", "evidence": [...], "confirm": "...", "citation",
"tied_with": [...], "tier"}`` (``tier``: the tier the diagnosis used). Evidence is phrased in classes (``"= 1/W"``, ``"0 where the plan has
1"``), never in rounding digits.
"""
from __future__ import annotations

from typing import Callable

__all__ = ["diagnose", "features", "FINGERPRINTS", "register_fingerprint", "NO_KNOWN_CAUSE",
           "AGREE_REL", "TIERS", "lowest_tier", "UNREGISTERED_FORWARD", "FORWARD_ONLY"]

NO_KNOWN_CAUSE = "no known cause"
#: Named in the tie of a cause whose evidence is only "the forward is wrong and nothing else
#: is seen": a scale or layout error of the sharded path outside the registry fits it too.
UNREGISTERED_FORWARD = "another error of the sharded forward (not in the registry)"
#: Two observables "agree" when within this relative distance: two correct float32
#: computations of the same sums differ by ~1e-7 relative at these sizes; every bug of the
#: registry moves the observables its fingerprint tests by more (tests/bugs/test_diagnose.py's
#: confusion table would miss a bug that hid under it).
AGREE_REL = 1e-4


def _close(a: float, b: float, rel: float = AGREE_REL) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


def _spread(values: list[float]) -> bool:
    """True when the values do not all agree."""
    return any(not _close(v, values[0]) for v in values)


def _count(ledger: list[dict], phase: str) -> int:
    return sum(e["phase"] == phase for e in ledger)


def features(obs: dict) -> dict:
    """The yes/no facts and counts the fingerprints test, computed from ``obs``."""
    setup = obs["setup"]
    w = setup["world_size"]
    f = {
        "world_size": w,
        "bias": setup.get("bias", False), "fused_qkv": setup.get("fused_qkv", False),
        "grad_clip": setup.get("grad_clip", False),
        "kv_per_rank": setup["kv_heads"] // w if setup["kv_heads"] >= w else 0,
        "gqa": setup["query_heads"] > setup["kv_heads"],
        "losses_agree": not _spread(obs["rank_losses"]),
        "losses_per_rank": setup.get("logged_loss", "per_rank") == "per_rank",
        "batches_agree": len(set(obs["batch_checksums"])) == 1,
        "shards_ok": {k: all(abs(d) <= 1e-5 * max(obs["shard_scale"][k], 1.0) for d in v)
                      for k, v in obs["shard_checksums"].items()},
        # replicas get the same all-reduced gradient and the same update: the same bits
        "replicas_agree_1": all(len(set(v)) == 1 for v in obs["replica_checksums"]["after_1"].values()),
        "norm_replicas_agree_1": len(set(obs["replica_checksums"]["after_1"]["norm"])) == 1,
        "kv_replicas_agree_1": all(len(set(v)) == 1 for k, v in
                                   obs["replica_checksums"]["after_1"].items() if k[:2] in ("wk", "wv")),
        "sequence_parallel": setup.get("sequence_parallel", False),
        "after_bwd": _count(obs["ledger"], "after backward"),
        "after_bwd_plan": _count(obs["planned_ledger"], "after backward"),
        "kv_reduces": sum(e["group"] == "kv_replicas" for e in obs["ledger"]),
        "kv_reduces_plan": sum(e["group"] == "kv_replicas" for e in obs["planned_ledger"]),
        "replicas_agree_k": all(len(set(v)) == 1 for v in obs["replica_checksums"]["after_k"].values()),
        "fwd": _count(obs["ledger"], "forward"), "bwd": _count(obs["ledger"], "backward"),
        "fwd_plan": _count(obs["planned_ledger"], "forward"),
        "bwd_plan": _count(obs["planned_ledger"], "backward"),
        "groups_ok": [e["group"] for e in obs["ledger"]] == [e["group"] for e in obs["planned_ledger"]]
        if len(obs["ledger"]) == len(obs["planned_ledger"]) else None,
    }
    f["ledger_as_planned"] = obs["ledger"] == obs["planned_ledger"]
    ref = obs.get("reference")
    f["has_reference"] = ref is not None
    if ref is not None:
        ratio = obs["grad_norm_ratio"]
        f["loss_matches"] = _close(obs["rank_losses"][0], ref["rank_losses"][0])
        f["curve_matches"] = all(_close(a, b) for a, b in zip(obs["loss_curve"], ref["loss_curve"]))
        f["grads_match"] = {k: _close(r, 1.0) for k, r in ratio.items()}
        f["norm_ratio_is"] = {"1/W": _close(ratio["norm"], 1 / w), "W": _close(ratio["norm"], w),
                              "1": _close(ratio["norm"], 1.0)}
        f["logged_norm_high"] = obs["logged_grad_norm"] > ref["logged_grad_norm"] * (1 + AGREE_REL)
        f["logged_norm_matches"] = _close(obs["logged_grad_norm"], ref["logged_grad_norm"])
        f["bias_shift_along_bias"] = (obs.get("bias_grad_shift_cosine", 0.0) > 1 - 1e-3)
    return f


# --- fingerprints: (name, test(features) -> bool, evidence text) ---------------------------

def _c(text: str, test: Callable[[dict], bool]):
    return (text, test)


def _ref(test):
    def needs_good_run(f):
        return f["has_reference"] and test(f)
    needs_good_run.tier = 2
    return needs_good_run


def _when(condition, applies, tier: int = 1):
    """``condition`` (``(text, test)``), used only where ``applies(features)``: elsewhere it
    is skipped (neither held nor failed, not scored)."""
    text, test = condition

    def where_it_applies(f):
        return test(f)
    where_it_applies.applies, where_it_applies.tier = applies, tier
    return (text, where_it_applies)


def _extra(condition):
    """A condition on the good run that only adds to a fingerprint already visible without
    it: skipped when there is no good run."""
    return _when(condition, lambda f: f["has_reference"], tier=2)


def _applies(test, f: dict) -> bool:
    return getattr(test, "applies", lambda _: True)(f)


_SHARDS_OK = _c("every rank loaded the checkpoint slices it should hold (shard checksums)",
                lambda f: all(f["shards_ok"].values()))
_SAME_DATA = _c("every rank saw the same batch (batch checksums agree)", lambda f: f["batches_agree"])
_LEDGER = _c("the collectives are the planned ones (count and group)", lambda f: f["ledger_as_planned"])
_LOSSES_AGREE = _c("the ranks' step-0 losses agree", lambda f: f["losses_agree"])
_LOSS_OK = _c("the step-0 loss equals the good run's (the forward is right)",
              _ref(lambda f: f["loss_matches"]))
_LOSS_OFF = _c("the step-0 loss differs from the good run's (the forward is wrong)",
               _ref(lambda f: not f["loss_matches"]))
_W2 = _c("world size >= 2", lambda f: f["world_size"] >= 2)
_SP = _c("the job runs sequence parallelism", lambda f: f["sequence_parallel"])
_NORM_GRAD_OVER_W = _c("the norm weight's gradient norm is 1/W times the good run's",
                       _ref(lambda f: f["norm_ratio_is"]["1/W"]))
_SHARDED_GRADS_MATCH = _c("the sharded weights' gradients equal the good run's",
                          _ref(lambda f: all(f["grads_match"][k] for k in ("wq", "wk", "wv", "wo"))))

#: cause -> (conditions, the test that would confirm it)
FINGERPRINTS: dict[str, tuple[list, str]] = {
    "missing_output_reduce": ([
        _W2,
        _c("forward ledger: fewer all-reduces than the plan (g missing)",
           lambda f: f["fwd"] < f["fwd_plan"]),
        _when(_c("the ranks' step-0 losses disagree", lambda f: not f["losses_agree"]),
              lambda f: f["losses_per_rank"]),
    ], "all-reduce the output partials: every rank's loss should become the same"),
    "output_reduced_twice": ([
        _W2, _LOSSES_AGREE,
        _c("forward ledger: twice the planned all-reduces (g applied twice)",
           lambda f: f["fwd"] == 2 * f["fwd_plan"] > 0),
    ], "remove one all-reduce: the block's output drops by the factor W"),
    "missing_input_grad_reduce": ([
        _W2, _LOSSES_AGREE,
        _c("backward ledger: fewer all-reduces than the plan (f missing)",
           lambda f: f["bwd"] < f["bwd_plan"]),
        _c("the replicated norm weight differs across ranks after one step",
           lambda f: not f["norm_replicas_agree_1"]),
    ], "all-reduce dn in backward: the norm replicas stay identical"),
    "input_grad_reduced_twice": ([
        _W2, _LOSSES_AGREE, _extra(_LOSS_OK),
        _c("backward ledger: twice the planned all-reduces", lambda f: f["bwd"] == 2 * f["bwd_plan"] > 0),
        _extra(_c("the norm weight's gradient norm is W times the good run's",
                  _ref(lambda f: f["norm_ratio_is"]["W"]))),
    ], "drop the second all-reduce: the norm gradient falls by exactly W"),
    "input_grad_reduce_averaged": ([
        _W2, _LEDGER, _LOSSES_AGREE, _LOSS_OK, _SAME_DATA, _SHARDS_OK,
        _NORM_GRAD_OVER_W, _SHARDED_GRADS_MATCH,
    ], "reduce dn with SUM instead of AVG: the norm gradient grows by exactly W"),
    "grad_norm_counts_replicas": ([
        _W2, _LEDGER, _LOSSES_AGREE, _LOSS_OK, _SAME_DATA, _SHARDS_OK,
        _c("every gradient equals the good run's", _ref(lambda f: all(f["grads_match"].values()))),
        _c("the logged global gradient norm is larger than the good run's",
           _ref(lambda f: f["logged_norm_high"])),
    ], "count replicated parameters on one rank: the logged norm equals the TP = 1 norm"),
    "row_bias_on_every_rank": ([
        _W2, _LEDGER, _LOSSES_AGREE, _LOSS_OFF, _SAME_DATA, _SHARDS_OK,
        _c("the model has a row-parallel output bias", lambda f: f["bias"]),
        _c("the bias gradient moved along the bias itself (an extra copy of b in the output)",
           _ref(lambda f: f["bias_shift_along_bias"])),
    ], "add the bias after the all-reduce: the output drops by exactly (W-1)*b"),
    "fused_qkv_naive_split": ([
        _W2, _c("the checkpoint stores a fused [Wq; Wk; Wv]", lambda f: f["fused_qkv"]),
        _c("ranks loaded Q/K/V numbers that are not their slices (shard checksums differ)",
           lambda f: not (f["shards_ok"]["wq"] and f["shards_ok"]["wk"] and f["shards_ok"]["wv"])),
        _c("the output projection's shards are right", lambda f: f["shards_ok"]["wo"]),
    ], "split Wq, Wk, Wv by heads: each rank's Q/K/V checksums match the checkpoint's slices"),
    "repeat_kv_tiled": ([
        _W2, _LEDGER, _LOSSES_AGREE, _LOSS_OFF, _SAME_DATA, _SHARDS_OK,
        _c("each rank holds >= 2 KV heads with >= 2 query heads each (tiling differs from "
           "interleaving)", lambda f: f["kv_per_rank"] >= 2 and f["gqa"]),
        _c("no extra bias explains the shift", _ref(lambda f: not (f["bias"] and f["bias_shift_along_bias"]))),
    ], "rerun with one KV head per rank (TP = kv_heads): a tiled repeat_kv is then exact"),
    "missing_norm_grad_reduce": ([
        _W2, _SP, _LOSSES_AGREE,
        _c("after backward: fewer all-reduces than the plan (the norm gradient's)",
           lambda f: f["after_bwd"] < f["after_bwd_plan"]),
        _c("the replicated norm weight differs across ranks after one step",
           lambda f: not f["norm_replicas_agree_1"]),
    ], "all-reduce the norm weight's gradient over the TP group: the norm replicas stay "
       "identical"),
    "norm_grad_averaged": ([
        _W2, _SP, _LEDGER, _LOSSES_AGREE, _LOSS_OK, _SAME_DATA, _SHARDS_OK,
        _NORM_GRAD_OVER_W, _SHARDED_GRADS_MATCH,
    ], "reduce the norm gradient with SUM, not AVG: it grows by exactly W"),
    "missing_kv_grad_reduce": ([
        _W2, _LOSSES_AGREE,
        _c("backward: fewer all-reduces over the KV replica groups than the plan",
           lambda f: f["kv_reduces"] < f["kv_reduces_plan"]),
        _c("wk/wv differ across the ranks of a replica group after one step",
           lambda f: not f["kv_replicas_agree_1"]),
        _c("the replicated norm weight stays identical", lambda f: f["norm_replicas_agree_1"]),
    ], "all-reduce wk/wv gradients over each KV replica group: the replicas stay identical"),
    "inputs_not_replicated": ([
        _W2, _c("the ranks' batch checksums differ", lambda f: not f["batches_agree"]),
    ], "broadcast the batch from TP rank 0: the batch checksums and losses agree"),
}


#: Causes whose fingerprint, beyond "the forward is wrong and nothing else deviates", only
#: checks that the setup allows them: the answer names ``UNREGISTERED_FORWARD`` in their tie.
FORWARD_ONLY = {"repeat_kv_tiled"}


def register_fingerprint(cause: str, conditions: list, confirm: str) -> None:
    """Add the fingerprint of a cause another module contributes (``conditions``: ``(text,
    test(features) -> bool)`` pairs)."""
    FINGERPRINTS[cause] = (list(conditions), confirm)


#: What a diagnosis can use: tier 1, only what the live job shows (losses as logged, checksums,
#: the ledger against the plan); tier 2, also a known-good run on the same checkpoint and data.
TIERS = {1: "the live job alone", 2: "the live job and a known-good run"}


def lowest_tier(cause: str) -> int | None:
    """The lowest tier (``TIERS``) at which ``cause``'s fingerprint can hold: 2 when one of
    its conditions compares with a known-good run, else 1; ``None`` without a fingerprint."""
    if cause not in FINGERPRINTS:
        return None
    return max((getattr(test, "tier", 1) for _, test in FINGERPRINTS[cause][0]
                if not hasattr(test, "applies")), default=1)


def _deviations(f: dict) -> list[str]:
    seen = []
    if not f["losses_agree"]:
        seen.append("the ranks' step-0 losses disagree")
    if not f["batches_agree"]:
        seen.append("the ranks' batches differ")
    if not f["ledger_as_planned"]:
        seen.append("the collectives differ from the plan")
    if not all(f["shards_ok"].values()):
        seen.append("some shards differ from the checkpoint's slices")
    if not f["replicas_agree_1"] or not f["replicas_agree_k"]:
        seen.append("replicated parameters differ across ranks")
    if f["has_reference"]:
        if not f["loss_matches"]:
            seen.append("the step-0 loss differs from the good run's")
        if not all(f["grads_match"].values()):
            seen.append("gradient norms differ from the good run's: "
                        + ", ".join(k for k, ok in f["grads_match"].items() if not ok))
        if not f["logged_norm_matches"]:
            seen.append("the logged gradient norm differs from the good run's")
        if not f["curve_matches"]:
            seen.append("the loss curve leaves the good run's")
    return seen


_FIVE = ("forward_max_abs_diff", "loss_abs_diff", "input_grad_max_abs_diff",
         "parameter_grad_max_abs_diff", "post_step_weight_max_abs_diff")


def _from_five_measures(result: dict, cfg, signatures: dict | None, forward=None) -> list[dict]:
    from tpattn.check.core import TOLERANCE
    from tpattn.config import Config

    cfg = cfg or Config()
    from tpattn.bugs.zoo import REGISTRY, runnable_modes
    from tpattn.bugs.zoo import run as zoo_run

    failing = tuple(m for m in _FIVE if result[m] >= TOLERANCE)
    if not failing:
        return [{"cause": NO_KNOWN_CAUSE, "score": 0, "evidence": ["all five measures pass"],
                 "confirm": "-", "citation": None, "tied_with": []}]
    if signatures is None:
        signatures = {}
        for mode in runnable_modes():
            try:
                r = zoo_run(11, mode, cfg, "ranks")
            except ValueError:  # the shape does not meet the mode's needs
                continue
            signatures[mode] = tuple(m for m in _FIVE if r[m] >= TOLERANCE)
    matches = [m for m, sig in signatures.items() if sig == failing and sig]
    printed = {}  # cause -> does the run's error equal that cause's exact error?
    if forward is not None:
        from .fingerprints import FINGERPRINTS as EXACT
        printed = {m: EXACT[m](forward, result["seed"], cfg) for m in matches if m in EXACT}
        ruled_out = [m for m, ok in printed.items() if not ok]
        matches = [m for m in matches if m not in ruled_out]
        if not matches:
            return [{"cause": NO_KNOWN_CAUSE, "score": 0,
                     "evidence": ["failing measures: " + ", ".join(failing)]
                     + [f"the signature of {m}, not its numerical fingerprint" for m in ruled_out],
                     "confirm": "-", "citation": None, "tied_with": []}]
    if not matches:
        return [{"cause": NO_KNOWN_CAUSE, "score": 0,
                 "evidence": ["failing measures: " + ", ".join(failing)],
                 "confirm": "-", "citation": None, "tied_with": []}]
    found = [{"cause": m, "score": len(failing) + printed.get(m, False),
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
    """Add to each candidate that is a registry mode its static verdict (``tpattn.diagnosis.typecheck``
    at ``cfg``): ``"tier0": {"used": True, "verdict", "where", "why"}``; a cause the shape
    cannot run statically gets ``{"used": False, "why": <the rule>}``."""
    from .typecheck import typecheck
    from tpattn.bugs.zoo import REGISTRY

    for c in candidates:
        if c["cause"] not in REGISTRY:
            continue
        try:
            t = typecheck(c["cause"], cfg)
        except ValueError as e:
            c["tier0"] = {"used": False, "why": str(e)}
            continue
        c["tier0"] = {"used": True, "verdict": t["verdict"], "where": t["where"],
                      "why": t["why"]}
    return candidates


def diagnose(observations: dict, cfg=None, signatures: dict | None = None,
             forward=None, tier0: bool = False) -> list[dict]:
    """Candidate causes of what ``observations`` show, best first (see the module docstring).

    ``observations``: ``tpattn.observe``'s dict, or a ``tpattn.run`` result (the five
    measures; ``cfg`` is then its shape, default the seed's, and ``signatures`` may give the
    modes' failing-measure tuples to match, else they are measured at seed 11). With
    ``forward`` (the run's TP ``forward(x, params, cfg)``, fixture view), a missing reduction
    whose signature matches is also tested by its numerical fingerprint
    (``tpattn.diagnosis.fingerprints``): kept, one point higher, when the error is exactly what it
    leaves, ruled out when not.
    Returns at least one entry; ``[{"cause": "no known cause", ...}]`` when nothing fits.
    ``tier0=True`` also says, for each candidate of the registry, whether the type checker
    catches it before anything runs (``tpattn.diagnosis.typecheck`` at ``cfg``, or the observed setup's
    world size and head counts): an added ``"tier0"`` entry; nothing else changes.
    """
    found = _diagnose(observations, cfg, signatures, forward)
    if not tier0:
        return found
    if cfg is None:
        from tpattn.config import Config

        setup = observations.get("setup")
        cfg = Config() if setup is None else Config(
            world_size=setup["world_size"], query_heads=setup["query_heads"],
            kv_heads=setup["kv_heads"])
    return _tier0(found, cfg)


def _diagnose(observations: dict, cfg, signatures: dict | None, forward=None) -> list[dict]:
    if not isinstance(observations, dict):
        raise ValueError(f"observations must be a dict from tpattn.observe or tpattn.run "
                         f"(got {type(observations).__name__})")
    if all(m in observations for m in _FIVE) and "setup" not in observations:
        return _from_five_measures(observations, cfg, signatures, forward)
    missing = [k for k in ("setup", "rank_losses", "batch_checksums", "shard_checksums",
                           "replica_checksums", "ledger", "planned_ledger") if k not in observations]
    if missing:
        raise ValueError(f"observations must have the keys of tpattn.observe (missing: "
                         f"{', '.join(missing)})")
    from tpattn.bugs.zoo import REGISTRY

    f = features(observations)
    tier = 2 if f["has_reference"] else 1
    found = []
    for cause, (conditions, confirm) in FINGERPRINTS.items():
        used = [(text, test) for text, test in conditions if _applies(test, f)]
        if all(test(f) for _, test in used):
            found.append({"cause": cause, "score": len(used),
                          "evidence": [text for text, _ in used],
                          "confirm": confirm, "tier": tier,
                          "citation": REGISTRY[cause].citation if cause in REGISTRY else None})
    if not found:
        evidence = _deviations(f) or ["nothing deviates from a correct run"]
        if tier == 1:
            blind = [c for c in FINGERPRINTS if lowest_tier(c) == 2]
            evidence.append("tier 1 cannot see: " + ", ".join(blind)
                            + " (their fingerprints compare with a known-good run)")
        return [{"cause": NO_KNOWN_CAUSE, "score": 0, "evidence": evidence,
                 "confirm": "-", "citation": None, "tied_with": [], "tier": tier}]
    found.sort(key=lambda c: -c["score"])
    for c in found:
        c["tied_with"] = [o["cause"] for o in found if o is not c and o["score"] == c["score"]]
        if c["cause"] in FORWARD_ONLY:
            c["tied_with"].append(UNREGISTERED_FORWARD)
    return found
