"""How honest ``tpattn.diagnose`` is at each tier, on cases its fingerprints were not written on.

Runs ``tpattn.diagnosis.evaluate`` (held-out shapes, seeds 500-504 by default, every registry
bug at tier 1 and tier 2; every coexisting pair of bugs; the made-up bugs outside the
registry) and prints one row per tier and mode, then the totals.

    python bench/diagnosis_tiers.py [--seeds 500 501 502 503 504]
"""
from __future__ import annotations

import argparse
from collections import Counter

from tpattn.bugs.zoo import REGISTRY
from tpattn.diagnosis.evaluate import (CLASSES, made_up_cases, single_bug_cases, summary,
                                       two_bug_cases)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[500, 501, 502, 503, 504])
    args = ap.parse_args()
    single = single_bug_cases(args.seeds)
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
    reduced = single_bug_cases(args.seeds, logged_loss="all_reduced")
    print("the same cases, the job all-reducing its loss: "
          + ("the same answers" if reduced == single else
             f"{sum(reduced[k] != v for k, v in single.items())} answers differ"))
    two = two_bug_cases(args.seeds)
    for tier in (1, 2):
        rows = [v for (t, _, _), v in two.items() if t == tier]
        print(f"two bugs at once, tier {tier}: {len(rows)} cases; both named "
              f"{sum(n == 2 for n, _ in rows)}, one {sum(n == 1 for n, _ in rows)}, none "
              f"{sum(n == 0 for n, _ in rows)}; a registry cause outside the pair at the top "
              f"{sum(o for _, o in rows)}")
    made = made_up_cases(args.seeds)
    for tier in (1, 2):
        answers = Counter(v for (t, _, _), v in made.items() if t == tier)
        print(f"made-up bugs, tier {tier}: " + ", ".join(f"{k} {n}" for k, n in answers.items()))


if __name__ == "__main__":
    main()
