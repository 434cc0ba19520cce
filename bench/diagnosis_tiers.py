"""How honest ``tpattn.diagnose`` is at each tier, on cases its fingerprints were not written on.

Runs ``tpattn.diagnosis.evaluate`` (held-out shapes, seeds 500-504 by default, every registry
bug at tier 1 and tier 2; every coexisting pair of bugs; the made-up bugs outside the
registry) and prints one row per tier and mode, then the totals; ``--tuning`` runs the set the
fingerprints are tuned on instead (``TUNING`` shapes; pass ``--seeds 0 1 ... 9``).
``--exclude MODE ...`` leaves modes out of the single bugs and the pairs;
``--loading`` runs only the checkpoint-loading modes (``evaluate.LOADING_MODES``) on their
held-out shapes (``LOADING_HELD_OUT``): their
single-bug cases, their pairs with the other plain-TP bugs, and the made-up loading bugs
(``MADE_UP_LOADING``) at W=2 and W=4; ``--model`` the held-out shapes with dropout and
qk-norm (``MODEL_HELD_OUT``: their bugs and the seed's two, single bugs only); ``--mesh``
the TP x DP mesh's own held-out set (``HELD_OUT_MESH``, its single bugs only; with
``--tuning``, ``TUNING_MESH``: pass ``--seeds 21 34``).

``--smoke``: seed 500, the first held-out shape, the seed's two bugs, their pair and one
made-up bug (seconds).

    python bench/diagnosis_tiers.py [--seeds 500 501 502 503 504] [--tuning]
        [--exclude MODE ...] [--loading | --model | --mesh | --smoke]
"""
from __future__ import annotations

import argparse
from collections import Counter

from tpattn import MISSING_INPUT_GRAD_REDUCE, MISSING_OUTPUT_REDUCE
from tpattn.bugs.zoo import REGISTRY, runnable_modes
from tpattn.diagnosis.evaluate import (BOTH_NAMED, CLASSES, HELD_OUT, HELD_OUT_MESH,
                                       LOADING_HELD_OUT, LOADING_MODES, MADE_UP,
                                       MADE_UP_LOADING, MODEL_HELD_OUT,
                                       PAIR_CLASSES, TUNING, TUNING_MESH, made_up_cases,
                                       single_bug_cases, summary, two_bug_cases)


def _shapes(shapes, keep) -> list:
    """``shapes`` with every shape's modes (``None``: every plain-TP bug) narrowed to those
    ``keep(mode)`` accepts; a shape left with none is dropped."""
    out = []
    for name, cfg, modes in shapes:
        modes = tuple(m for m in modes or runnable_modes() if m != "equivalence" and keep(m))
        if modes:
            out.append((name, cfg, modes))
    return out


def _singles(single: dict) -> None:
    for tier in (1, 2):
        rows = summary(single, tier)
        print(f"tier {tier}:")
        for mode in REGISTRY:
            if mode in rows:
                print(f"  {mode:28s} " + " ".join(f"{k} {rows[mode][k]}" for k in CLASSES
                                                  if rows[mode][k]))
        total, n = rows["all"], sum(rows["all"].values())
        print(f"  all: {n} cases: " + ", ".join(f"{k} {total[k]}" for k in CLASSES)
              + f"; true bug top or tied {total['right'] + total['tied']}/{n}; honest "
              f"(not wrong, not missed) {n - total['wrong'] - total['missed']}/{n}")


def _pairs(two: dict) -> None:
    for tier in (1, 2):
        rows = Counter(v for (t, _, _), v in two.items() if t == tier)
        n = sum(rows.values())
        print(f"two bugs at once, tier {tier}: {n} cases; both named "
              f"{sum(rows[k] for k in BOTH_NAMED)}/{n} (" + ", ".join(
                  f"{k} {rows[k]}" for k in PAIR_CLASSES) + ")")


def _reduced(single: dict, reduced: dict) -> None:
    print("the same cases, the job all-reducing its loss: "
          + ("the same answers" if reduced == single else
             f"{sum(reduced[k] != v for k, v in single.items())} answers differ"))


#: ``--smoke``'s bugs: the seed's two.
SMOKE_MODES = (MISSING_OUTPUT_REDUCE, MISSING_INPUT_GRAD_REDUCE)


def smoke() -> None:
    """Seed 500 on the first held-out shape: the seed's two bugs alone and as a pair, and the
    first made-up bug; the same rows as a full run."""
    shapes = _shapes(HELD_OUT[:1], lambda mode: mode in SMOKE_MODES)
    single = single_bug_cases([500], shapes=shapes)
    _singles(single)
    _reduced(single, single_bug_cases([500], logged_loss="all_reduced", shapes=shapes))
    _pairs(two_bug_cases([500], shapes[0][1], lambda pair: set(pair) <= set(SMOKE_MODES)))
    made = made_up_cases([500], shapes[0][1], dict([next(iter(MADE_UP.items()))]))
    for tier in (1, 2):
        answers = Counter(v for (t, _, _), v in made.items() if t == tier)
        print(f"made-up bugs, tier {tier}: " + ", ".join(f"{k} {n}" for k, n in answers.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[500, 501, 502, 503, 504])
    ap.add_argument("--tuning", action="store_true",
                    help="the tuning set instead: TUNING shapes (pass --seeds 0 1 ... 9)")
    ap.add_argument("--model", action="store_true",
                    help="the held-out shapes with dropout and qk-norm (MODEL_HELD_OUT), "
                         "single bugs only")
    ap.add_argument("--mesh", action="store_true",
                    help="the TP x DP mesh's set instead: HELD_OUT_MESH (TUNING_MESH with "
                         "--tuning), single bugs only")
    ap.add_argument("--exclude", nargs="+", default=[], metavar="MODE",
                    help="leave these modes out of the single bugs and the pairs")
    ap.add_argument("--loading", action="store_true",
                    help="only the checkpoint-loading modes and the made-up loading bugs")
    ap.add_argument("--smoke", action="store_true",
                    help="one seed, one shape, two bugs: checks the script runs, in seconds")
    args = ap.parse_args()
    if args.smoke:
        return smoke()
    if args.model or args.mesh:
        sets = (TUNING_MESH if args.tuning else HELD_OUT_MESH) if args.mesh else MODEL_HELD_OUT
        _singles(single_bug_cases(args.seeds, shapes=sets))
        return
    if args.loading:
        def keep(mode):
            return mode in LOADING_MODES
    else:
        def keep(mode):
            return mode not in args.exclude
    shapes = _shapes(TUNING if args.tuning else LOADING_HELD_OUT if args.loading else HELD_OUT,
                     keep)
    single = single_bug_cases(args.seeds, shapes=shapes)
    _singles(single)
    _reduced(single, single_bug_cases(args.seeds, logged_loss="all_reduced", shapes=shapes))
    pair_keep = (lambda pair: any(map(keep, pair))) if args.loading \
        else (lambda pair: all(map(keep, pair)))
    _pairs(two_bug_cases(args.seeds, shapes[0][1], pair_keep,
                         LOADING_MODES if args.loading else ()))
    made = made_up_cases(args.seeds, shapes[0][1], MADE_UP_LOADING if args.loading else None)
    if args.loading:  # and at four ranks
        made.update({(t, f"{n} (W4)", s): v for (t, n, s), v in made_up_cases(
            args.seeds, shapes[1][1], MADE_UP_LOADING).items()})
    for tier in (1, 2):
        answers = Counter(v for (t, _, _), v in made.items() if t == tier)
        print(f"made-up bugs, tier {tier}: " + ", ".join(f"{k} {n}" for k, n in answers.items()))


if __name__ == "__main__":
    main()
