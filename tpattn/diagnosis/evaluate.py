"""How honest ``diagnose`` is, per tier, on cases its fingerprints were not written on: they are
tuned on ``TUNING`` (and ``TUNING_MESH``); ``HELD_OUT`` and its kin are other shapes, run at other
seeds, at tier 1 and tier 2; ``classify`` puts each answer in one of ``CLASSES``. Two bugs at
once (``pairs``) and bugs outside the registry (``MADE_UP``) too."""
from __future__ import annotations

import dataclasses
from collections import Counter
from itertools import combinations

from tpattn.config import Config
from tpattn.parallel.injection import Injection
from tpattn.bugs.zoo import AROUND_THE_BLOCK, REGISTRY, resolve, runnable_modes
from .diagnose import NO_KNOWN_CAUSE, UNREGISTERED_FORWARD, diagnose
from .observe import observe_injection

__all__ = ["HELD_OUT", "MODEL_HELD_OUT", "HELD_OUT_MESH", "TUNING", "TUNING_MESH",
           "MESH_SEEDS", "MADE_UP", "MADE_UP_LOADING", "LOADING_MODES", "LOADING_HELD_OUT",
           "CLASSES", "PAIR_CLASSES", "named", "classify", "pair_class", "BOTH_NAMED",
           "single_bug_answers", "single_bug_cases", "answer_label", "confusion", "pairs",
           "two_bug_cases", "made_up_cases", "summary"]

_FIXTURE_BUGS = ("missing_output_reduce", "missing_input_grad_reduce")
_SP_MODES = _FIXTURE_BUGS + ("missing_norm_grad_reduce", "norm_grad_averaged")
_DROP = ("dropout_rng_desync",)
_QKN = ("qk_norm_grad_not_reduced",)
_MESH_MODES = ("loss_reduced_over_world", "loss_full_tensor_tp_only", "dp_grad_group_of_one")
_SP_MESH_MODES = _MESH_MODES + ("sp_gather_wrong_group",)
#: The checkpoint-loading modes (not in ``runnable_modes()``).
LOADING_MODES = AROUND_THE_BLOCK


def _shape(world: int, hq: int, kv: int, head_dim: int, seq: int = 4, hidden: int = 32,
           **options) -> Config:
    """A held-out ``Config``: ``world`` TP ranks, ``hq`` query and ``kv`` KV heads."""
    return Config(seq=seq, hidden=hidden, query_heads=hq, kv_heads=kv, head_dim=head_dim,
                  world_size=world, **options)


_W2, _W4, _W8 = _shape(2, 8, 4, 8, seq=6), _shape(4, 16, 8, 4), _shape(8, 32, 16, 4)
#: Held-out shapes: (name, Config, its modes; None: every plain-TP mode whose needs it meets).
HELD_OUT = [
    ("W2 hq8 kv4", _W2, None),
    ("W4 hq16 kv8", _W4, None),
    ("SP W4", _shape(4, 8, 4, 8, seq=8, sequence_parallel=True), _SP_MODES),
    ("KV W4", _shape(4, 8, 2, 8), _FIXTURE_BUGS + ("missing_kv_grad_reduce",)),
    ("SP W4 hq16 kv8", _shape(4, 16, 8, 4, seq=8, sequence_parallel=True), _SP_MODES),
    ("KV gather W4", _shape(4, 8, 2, 8, kv_strategy="gather_activations"), _FIXTURE_BUGS),
    ("W8 hq32 kv16", _W8, None),
]
#: The checkpoint-loading modes' held-out shapes (``bench/diagnosis_tiers.py --loading``).
LOADING_HELD_OUT = [
    ("W2 hq8 kv4", _W2, LOADING_MODES), ("W4 hq16 kv8", _W4, LOADING_MODES),
    ("W8 hq32 kv16", _W8, LOADING_MODES),
    ("W2 hq16 kv8", _shape(2, 16, 8, 4, seq=6), LOADING_MODES),
    ("W2 hq12 kv4", _shape(2, 12, 4, 4, seq=5, hidden=24), LOADING_MODES),
    ("W4 hq8 kv8 MHA", _shape(4, 8, 8, 4), LOADING_MODES),
    ("W4 hq8 kv4", _shape(4, 8, 4, 8), ("qkv_loaded_from_rank0",)),
]
#: Held-out shapes with dropout and qk-norm (``bench/diagnosis_tiers.py --model``).
MODEL_HELD_OUT = [
    ("drop W2 hq8 kv4", _shape(2, 8, 4, 8, seq=6, dropout=0.1), _FIXTURE_BUGS + _DROP),
    ("qk-norm W2 hq4 kv2", _shape(2, 4, 2, 6, seq=5, hidden=24, qk_norm=True),
     _FIXTURE_BUGS + _QKN),
    ("drop qk-norm W4 hq8 kv4", _shape(4, 8, 4, 8, dropout=0.2, qk_norm=True),
     _FIXTURE_BUGS + _DROP + _QKN),
    ("qk-norm W4 hq16 kv8", _shape(4, 16, 8, 4, qk_norm=True), _FIXTURE_BUGS + _QKN),
    ("drop W4 hq8 kv8", _shape(4, 8, 8, 4, seq=6, hidden=16, dropout=0.05), _FIXTURE_BUGS + _DROP),
]
#: The TP x DP mesh's held-out shapes (seeds ``MESH_SEEDS``).
HELD_OUT_MESH = [
    ("TP2xDP2", _shape(2, 8, 4, 8, seq=6, data_parallel=2), _MESH_MODES),
    ("TP4xDP2", _shape(4, 16, 8, 4, data_parallel=2), _MESH_MODES),
    ("TP2xDP4", _shape(2, 8, 2, 8, batch=3, data_parallel=4), _MESH_MODES),
    ("SP TP2xDP2", _shape(2, 8, 4, 8, seq=8, data_parallel=2, sequence_parallel=True),
     _SP_MESH_MODES),
    ("TP4xDP4-SP", _shape(4, 8, 4, 8, seq=8, data_parallel=4, sequence_parallel=True),
     _SP_MESH_MODES),
]
#: The shapes the fingerprints are tuned on (seeds 0-9).
TUNING = [
    ("W2, 2 KV heads per rank", Config(query_heads=8, kv_heads=4), None),
    ("W4, 2 KV heads per rank", Config(seq=4, query_heads=16, kv_heads=8, world_size=4), None),
]
#: The mesh modes' tuning shape (seeds 21, 34).
TUNING_MESH = [("TP2xDP2 tuning", Config(seq=4, data_parallel=2, sequence_parallel=True),
                _SP_MESH_MODES)]
#: Bugs outside the registry (``Injection``'s test knobs), two ranks.
MADE_UP = {
    "attention partial x 1.05": Injection(partial_scale=1.05),
    "attention partial x 0.5": Injection(partial_scale=0.5),
    "shards loaded in the wrong rank order": Injection(shard_offset=1),
    "one rank's learning rate x 1.05": Injection(rank_lr_scale=(1.0, 1.05)),
    "one rank's learning rate x 0.9": Injection(rank_lr_scale=(0.9, 1.0)),
    "partial x 1.05 and wrong rank order": Injection(partial_scale=1.05, shard_offset=1),
    "rank 1 keeps its pre-step weights (stale shard)": Injection(rank_lr_scale=(1.0, 0.0)),
    "rank 1's attention partial x 1.05": Injection(partial_scale=(1.0, 1.05)),
}
#: Made-up loading bugs (a fused checkpoint): every rank's whole shard from another rank.
MADE_UP_LOADING = {
    "fused checkpoint loaded in the wrong rank order": Injection(shard="fused", shard_offset=1),
    "grouped checkpoint loaded in the wrong rank order": Injection(shard="grouped",
                                                                   shard_offset=1),
}
#: An answer's class: the true bug alone at the top, in a tie, "no known cause" naming it
#: among those the tier cannot see, "no known cause" without, another cause named confidently.
CLASSES = ("right", "tied", "blind", "missed", "wrong")
#: The held-out seeds of ``HELD_OUT_MESH``.
MESH_SEEDS = (500, 501, 502, 503, 504)


def named(found: list[dict]) -> set[str]:
    """The causes ``diagnose``'s answer names at the top: the first, its ``with``, its tie."""
    top = found[0]
    return {top["cause"], *top.get("with", []), *top["tied_with"]}


def classify(found: list[dict], mode: str) -> str:
    """The class (``CLASSES``) of ``diagnose``'s answer when the true bug is ``mode``."""
    top = found[0]
    if top["cause"] == NO_KNOWN_CAUSE:
        blind = any(mode in e and "cannot see" in e for e in top["evidence"])
        return "blind" if blind else "missed"
    if mode in named(found) and top["tied_with"]:
        return "tied"
    if top["cause"] == mode and not top.get("with"):
        return "right"
    return "wrong"


def _both_tiers(inj: Injection, seeds, cfg: Config, logged_loss: str = "per_rank"):
    """``(tier, seed, diagnose's answer)`` for ``inj`` at every seed, tier 1 then tier 2."""
    for seed in seeds:
        for tier in (1, 2):
            yield tier, seed, diagnose(observe_injection(
                inj, seed, cfg, reference=tier == 2, logged_loss=logged_loss))


def single_bug_answers(seeds, logged_loss: str = "per_rank", shapes=HELD_OUT) -> dict:
    """``(tier, mode, shape, seed) -> diagnose``'s answer for every registry bug on ``shapes``."""
    out = {}
    for name, cfg, modes in shapes:
        for mode in modes or [m for m in runnable_modes() if m != "equivalence"]:
            try:
                inj = resolve(mode, cfg, strict=True).injection
            except ValueError:  # this shape does not host the mode
                continue
            for tier, seed, found in _both_tiers(inj, seeds, cfg, logged_loss):
                out[(tier, mode, name, seed)] = found
    return out


def single_bug_cases(seeds, logged_loss: str = "per_rank", shapes=HELD_OUT,
                     answers: dict | None = None) -> dict:
    """``(tier, mode, shape, seed) -> classify`` of ``single_bug_answers`` (or ``answers``)."""
    answers = single_bug_answers(seeds, logged_loss, shapes) if answers is None else answers
    return {key: classify(found, key[1]) for key, found in answers.items()}


def answer_label(found: list[dict]) -> str:
    """``diagnose``'s answer in one line: ``"a + b | tie: c, unregistered"``."""
    top = found[0]
    ties = ["unregistered" if c == UNREGISTERED_FORWARD else c for c in top["tied_with"]]
    return " + ".join([top["cause"], *top.get("with", [])]) + (
        " | tie: " + ", ".join(ties) if ties else "")


def confusion(answers: dict) -> dict:
    """``(tier, true mode) -> Counter(answer_label)`` over ``single_bug_answers``' dict."""
    out = {}
    for (tier, mode, _, _), found in answers.items():
        out.setdefault((tier, mode), Counter())[answer_label(found)] += 1
    return out


def pairs(extra=()):
    """``((mode_a, mode_b), Injection)`` for every two registry bugs (``runnable_modes()`` and
    ``extra``) that set no knob in common, their knobs merged."""
    default = Injection()
    knobs = {}
    for mode in (*runnable_modes(), *extra):
        inj = REGISTRY[mode].injection
        changed = {f.name: getattr(inj, f.name) for f in dataclasses.fields(inj)
                   if getattr(inj, f.name) != getattr(default, f.name)}
        if changed:
            knobs[mode] = changed
    for a, b in combinations(sorted(knobs), 2):
        if not set(knobs[a]) & set(knobs[b]):
            yield (a, b), Injection(**knobs[a], **knobs[b])


#: Pair answers: both named as the explanation (no tie, or plus a tie), both named but one
#: only in the tie, one or none of the two named, a third cause named confidently.
PAIR_CLASSES = ("alone", "plus tie", "tied", "one", "none", "third")
#: The pair classes that name both bugs.
BOTH_NAMED = ("alone", "plus tie", "tied")


def pair_class(found: list[dict], pair: tuple[str, str]) -> str:
    """The class (``PAIR_CLASSES``) of ``diagnose``'s answer when the true bugs are ``pair``."""
    top = found[0]
    confident = {top["cause"], *top.get("with", [])} - {NO_KNOWN_CAUSE}
    if confident - set(pair) and not top["tied_with"]:
        return "third"
    if set(pair) <= confident:
        return "plus tie" if top["tied_with"] else "alone"
    return ("none", "one", "tied")[len(set(pair) & named(found))]


def two_bug_cases(seeds, cfg: Config = HELD_OUT[0][1], keep=None, extra=()) -> dict:
    """``(tier, pair, seed) -> pair_class`` for the pairs (``pairs(extra)``, filtered by
    ``keep``) on ``cfg``."""
    return {(tier, pair, seed): pair_class(found, pair)
            for pair, inj in pairs(extra) if keep is None or keep(pair)
            for tier, seed, found in _both_tiers(inj, seeds, cfg)}


def made_up_cases(seeds, cfg: Config = HELD_OUT[0][1], cases: dict | None = None) -> dict:
    """``(tier, name, seed) -> "no known cause"``, ``"tie"`` or the names given, for every bug
    of ``cases`` (default ``MADE_UP``)."""
    out = {}
    for name, inj in (MADE_UP if cases is None else cases).items():
        for tier, seed, (top, *_) in _both_tiers(inj, seeds, cfg):
            out[(tier, name, seed)] = (
                top["cause"] if top["cause"] == NO_KNOWN_CAUSE else "tie"
                if top["tied_with"] else " + ".join([top["cause"], *top.get("with", [])]))
    return out


def summary(single: dict, tier: int) -> dict:
    """``{mode: Counter, "all": Counter}`` of ``single_bug_cases``' classes at ``tier``."""
    out = {}
    for (t, mode, _, _), c in single.items():
        if t == tier:
            out.setdefault(mode, Counter())[c] += 1
            out.setdefault("all", Counter())[c] += 1
    return out
