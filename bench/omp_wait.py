"""What OpenMP's wait policy costs when several torch processes share the cores (a benchmark).

``make test`` and ``make book`` run many torch processes at once: pytest-xdist workers, their
notebook kernels, torchrun ranks. Between two parallel regions torch's OpenMP threads spin
(``OMP_WAIT_POLICY`` unset); with more runnable threads than cores, a spinning thread holds a
core that another process needs. ``OMP_WAIT_POLICY=PASSIVE`` (the Makefile's default) makes
idle threads sleep; the thread count, and with it every sum's order, is unchanged.

Runs the same workload — the five-measure check of every mode on the fixture's seeds, the
kind of small tensors the tests and chapters use — in ``--procs`` processes at once (default:
the CPU count), each with torch's default thread count, under each policy, and prints the wall
time and the CPU time of each, twice, interleaved. Exit status 0 (a timing, not a test).
``--smoke``: one process, one pass of the workload, each policy once (seconds).

    .venv/bin/python bench/omp_wait.py [--procs N] [--repeat R] [--smoke]
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

WORKLOAD = """
import tpattn
for _ in range({repeat}):
    for mode in tpattn.MODES:
        for seed in tpattn.SEEDS:
            tpattn.run(mode=mode, seed=seed)
"""


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(policy: str | None, procs: int, repeat: int) -> tuple[float, float]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    cpu0, t0 = children_cpu_s(), time.perf_counter()
    running = [subprocess.Popen([sys.executable, "-c", WORKLOAD.format(repeat=repeat)], env=env)
               for _ in range(procs)]
    if any(p.wait() != 0 for p in running):
        raise SystemExit("the workload failed")
    return time.perf_counter() - t0, children_cpu_s() - cpu0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--smoke", action="store_true",
                        help="one process, one repeat, each policy once: checks the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.procs, args.repeat = 1, 1
    print(f"{args.procs} processes at once on {os.cpu_count()} CPUs, each: "
          f"{args.repeat} x (every mode x every seed)")
    policies = (None, "PASSIVE") if args.smoke else (None, "PASSIVE", None, "PASSIVE")
    for policy in policies:  # each policy twice, interleaved (once with --smoke)
        wall, cpu = run(policy, args.procs, args.repeat)
        print(f"  OMP_WAIT_POLICY={policy or '(unset)':9s} wall {wall:6.1f} s   CPU {cpu:6.1f} s",
              flush=True)


if __name__ == "__main__":
    main()
