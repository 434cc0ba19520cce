"""`python -m tpattn --mode matrix` vs the seed fixture's script: same work, same cost?

Runs the two commands alternately (so drift in machine load hits both alike), N times each,
and prints the median wall times and their ratio (target: <= 1.05), and whether the two JSON
outputs are identical. The seed script is the original fixture's, from ``../shared/seed``
beside the checkout; where it is not there (a clone without it) only ``python -m tpattn``
is timed and one line says why (exit status 0). ``--smoke``: one timed run of each, no
warm-up (seconds).

Usage: python bench/cli_vs_seed.py [--runs N] [--seed-script PATH] [--smoke]
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_SEED = ROOT.parent / "shared" / "seed" / "tp_attention_fixture.py"


def timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--seed-script", type=pathlib.Path, default=None,
                    help=f"the original fixture's script (default: {DEFAULT_SEED})")
    ap.add_argument("--smoke", action="store_true",
                    help="one run of each, no warm-up: checks the script runs, in seconds")
    a = ap.parse_args()
    seed_script = a.seed_script or DEFAULT_SEED
    commands = {"tpattn": [sys.executable, "-m", "tpattn", "--mode", "matrix"]}
    if seed_script.is_file():
        commands["seed"] = [sys.executable, str(seed_script), "--mode", "matrix"]
    elif a.seed_script:
        print(f"seed script not found: {a.seed_script}", file=sys.stderr)
        return 2
    else:
        print(f"seed script not found at {DEFAULT_SEED}: timing python -m tpattn alone "
              "(pass --seed-script to compare)")
    runs = 1 if a.smoke else a.runs
    times: dict[str, list[float]] = {k: [] for k in commands}
    outputs: dict[str, str] = {}
    for name, cmd in commands.items():  # warm the page cache once, untimed
        outputs[name] = timed(cmd)[1] if not a.smoke else ""
    for i in range(runs):
        order = list(commands) if i % 2 == 0 else list(commands)[::-1]
        for name in order:
            seconds, out = timed(commands[name])
            times[name].append(seconds)
            outputs[name] = outputs[name] or out
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"runs each: {runs} (alternating)")
    for k, v in times.items():
        print(f"{k:>7}: median {med[k]:.3f} s   min {min(v):.3f} s   max {max(v):.3f} s")
    if "seed" in commands:
        print(f"  ratio tpattn/seed (medians): {med['tpattn'] / med['seed']:.3f}   "
              "(target <= 1.05)")
        print(f"  identical JSON: {outputs['tpattn'] == outputs['seed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
