"""A bug hunt: a hidden bug (``hunt_case``); the reader sees only the observables, in classes
("agree", "= 1/W", "larger"), never rounding digits (``describe``), and names a cause
(``judge``: right or not, and why)."""
from __future__ import annotations

import random

from tpattn.bugs.zoo import REGISTRY, runnable_modes
from tpattn.config import Config
from .diagnose import DEVIATIONS, FINGERPRINTS, NO_KNOWN_CAUSE, deviations, features

__all__ = ["hunt_case", "describe", "judge", "choices", "HUNT_SHAPES"]

#: Hunts' shapes: two KV heads per rank, so every registry bug can show.
HUNT_SHAPES = (Config(query_heads=8, kv_heads=4),
               Config(seq=4, query_heads=16, kv_heads=8, world_size=4))


def choices() -> list[str]:
    """``NO_KNOWN_CAUSE`` and every runnable registry bug."""
    return [NO_KNOWN_CAUSE] + [m for m in runnable_modes() if not REGISTRY[m].is_correct]


def hunt_case(n: int) -> tuple[str, int, Config]:
    """Hunt ``n``'s hidden ``(mode, seed, cfg)`` (``n``: any integer >= 0)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"hunt must be an integer >= 0 (got {n!r})")
    rng = random.Random(1000 + n)
    # equivalence included: "no known cause" is an answer
    return rng.choice(runnable_modes()), rng.randrange(100), rng.choice(HUNT_SHAPES)


def _agree(flag: bool, yes: str = "agree", no: str = "differ") -> str:
    return yes if flag else no


def describe(obs: dict) -> list[str]:
    """What the run shows, one line each (no dense model involved)."""
    f = features(obs)
    s = obs["setup"]
    lines = [
        f"setup: {s['world_size']} TP ranks, {s['kv_heads']} KV heads, "
        f"bias {'yes' if s['bias'] else 'no'}, fused QKV checkpoint "
        f"{'yes' if s['fused_qkv'] else 'no'}, clipping {'on' if s['grad_clip'] else 'off'}",
        "step-0 losses across ranks: " + _agree(f["losses_agree"]),
        "batch checksums across ranks: " + _agree(f["batches_agree"], "the same", "differ"),
        "shard checksums vs checkpoint: " + (
            "all match" if all(f["shards_ok"].values())
            else ", ".join(k for k, ok in f["shards_ok"].items() if not ok) + " differ"),
        f"ledger: forward {f['fwd']} (plan {f['fwd_plan']}), backward {f['bwd']} "
        f"(plan {f['bwd_plan']}); reduce ops "
        + ("as planned" if f["bwd_avg"] == f["bwd_avg_plan"] else "avg where the plan has sum"),
        "logged gradient norm vs the per-rank gradient norms: " + {
            "once": "replicated ones counted once", "per rank": "replicated ones counted on "
            "every rank", "neither": "neither total", "unknown": "not logged"}[f["logged_norm_is"]],
        "replicated weights after 1 step: " + _agree(f["replicas_agree_1"], "identical", "differ")
        + "; after the last: " + _agree(f["replicas_agree_k"], "identical", "differ"),
    ]
    if f["has_reference"]:
        ratio = obs["grad_norm_ratio"]
        def cls(r):
            w = s["world_size"]
            for name, value in (("same", 1.0), ("= 1/W", 1 / w), ("= W", float(w))):
                if abs(r - value) <= 1e-4 * value:
                    return name
            return "larger" if r > 1 else "smaller"
        lines += [
            "vs a known-good run: step-0 loss " + _agree(f["loss_matches"], "the same", "differs")
            + "; logged grad norm " + ("the same" if f["logged_norm_matches"]
                                       else "larger" if f["logged_norm_high"] else "smaller"),
            "gradient norms vs the good run: " + ", ".join(f"{k} {cls(r)}" for k, r in ratio.items()),
        ]
        if "output_outside_partials" in obs:
            lines.append("rank 0's output vs the good run: " + (
                "the same" if f["loss_matches"] else "a partial itself changed"
                if f["output_outside_partials"] else "moved within its rank partials and bias"))
        if s["bias"]:
            lines.append("bias gradient moved along the bias: "
                         + ("yes" if f["bias_shift_along_bias"] else "no"))
    return lines


def judge(obs: dict, truth: str, guess: str) -> tuple[bool, str]:
    """``(right, why)`` for ``guess`` when the hidden mode was ``truth``."""
    entry = REGISTRY.get(truth)
    answer = NO_KNOWN_CAUSE if entry is not None and entry.is_correct else truth
    if guess not in choices():
        raise ValueError(f"guess must be one of {', '.join(choices())} (got {guess!r})")
    f = features(obs)
    seen = deviations(f)
    if guess == answer:
        if answer == NO_KNOWN_CAUSE:
            return True, "Right: nothing deviates from a correct run; no fingerprint fits."
        fp = FINGERPRINTS[answer]
        return True, ("Right: " + "; ".join(DEVIATIONS[d][0] for d in seen if d in fp.explains)
                      + f". To confirm: {fp.confirm}.")
    if guess == NO_KNOWN_CAUSE:
        return False, "Not quite: something here does deviate from a correct run; look again."
    fp = FINGERPRINTS[guess]
    if not fp.allows(f):
        return False, f"Not {guess}: this setup cannot have it (see its needs in --list-modes)."
    missing = [d for d in fp.shows if d not in seen]
    if missing:
        return False, (f"Not {guess}: it would show \u201c{DEVIATIONS[missing[0]][0]}\u201d, "
                       f"which this run does not show.")
    unexplained = [d for d in seen if d not in fp.explains]
    if unexplained:
        return False, (f"Not {guess}: it does not explain \u201c{DEVIATIONS[unexplained[0]][0]}"
                       f"\u201d, which this run shows.")
    return False, (f"Not {guess}, though this run fits its fingerprint too: a tie "
                   f"the observables cannot break.")
