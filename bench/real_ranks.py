"""All 15 matrix cases on 2 real ranks vs the simulated matrix: what it costs, and where.

Like is compared with like:

- **end to end** (the target, <= 3x): a fresh process that prints the matrix's JSON —
  ``python -m tpattn --mode matrix`` (simulated ranks, one process) against
  ``python -m tpattn.distributed --mode matrix`` (it starts 2 rank processes itself) and
  ``torchrun --standalone --nproc-per-node 2 -m tpattn.distributed --mode matrix``.
  Commands alternate so that drift in machine load hits all alike; medians are reported.
- **where the time goes**, inside one Python process that has imported tpattn: ``import`` of
  the package (a fresh ``python -c``), ``run_matrix()`` alone (compute only), and
  ``run_distributed(2, dtensor=False)`` split into start-up (processes up and the process group
  joined) and compute (rank 0's 15 checks) — first call (the forkserver imports torch) and
  later calls (it forks ready ranks).

``--smoke``: no end-to-end commands (each module they run is only looked up), then one
``run_distributed(2)`` call (every mode, one seed) and one ``run_matrix()`` (seconds).

Usage: python bench/real_ranks.py [--runs N] [--smoke]
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCHRUN = pathlib.Path(sys.executable).with_name("torchrun")

COMMANDS = {
    "python -m tpattn (simulated)": [sys.executable, "-m", "tpattn", "--mode", "matrix"],
    "python -m tpattn.distributed (2 ranks)": [sys.executable, "-m", "tpattn.distributed",
                                               "--mode", "matrix"],
    "torchrun -m tpattn.distributed (2 ranks)": (
        [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"])
        + ["--standalone", "--nproc-per-node", "2", "-m", "tpattn.distributed", "--mode", "matrix"],
    "python -c 'import tpattn.real.ranks'": [sys.executable, "-c", "import tpattn.real.ranks"],
}
BASELINE = "python -m tpattn (simulated)"


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return time.perf_counter() - start


def end_to_end(runs: int) -> dict[str, list[float]]:
    times = {name: [] for name in COMMANDS}
    for name, cmd in COMMANDS.items():  # warm the page cache once, untimed
        timed(cmd)
    for i in range(runs):
        for name in (list(COMMANDS) if i % 2 == 0 else list(COMMANDS)[::-1]):
            times[name].append(timed(COMMANDS[name]))
    return times


def in_process(runs: int) -> dict[str, list[float]]:
    import torch

    import tpattn
    from tpattn.real.ranks import run_distributed

    rows: dict[str, list[float]] = {}
    report = run_distributed(2, dtensor=False)  # first call: starts the forkserver
    for key in ("startup_s", "compute_s", "total_s"):
        rows[f"run_distributed(2), first call: {key[:-2]}"] = [report.timings[key]]
    simulated = tpattn.run_matrix()
    assert [r["passed"] for r in report.results] == [r["passed"] for r in simulated]
    for _ in range(runs):
        report = run_distributed(2, dtensor=False)
        for key in ("startup_s", "compute_s", "total_s"):
            rows.setdefault(f"run_distributed(2), later calls: {key[:-2]}", []).append(report.timings[key])
    for threads in (torch.get_num_threads(), 1):
        torch.set_num_threads(threads)
        for _ in range(runs):
            start = time.perf_counter()
            tpattn.run_matrix()
            rows.setdefault(f"run_matrix() in-process, {threads} thread(s)", []).append(
                time.perf_counter() - start)
    return rows


def smoke() -> int:
    """Look up the modules of ``COMMANDS``; one small ``run_distributed`` and ``run_matrix``."""
    import tpattn
    from tpattn.real.ranks import run_distributed

    for name, cmd in COMMANDS.items():  # "-m MODULE", or "-c 'import MODULE'"
        module = cmd[cmd.index("-m") + 1] if "-m" in cmd else cmd[-1].split()[-1]
        if module != "torch.distributed.run" and importlib.util.find_spec(module) is None:
            raise SystemExit(f"{name}: module {module} not found")
    report = run_distributed(2, seeds=(tpattn.SEEDS[0],), dtensor=False)
    print("run_distributed(2), one seed, every mode: " + "   ".join(
        f"{key[:-2]} {report.timings[key]:.3f} s" for key in ("startup_s", "compute_s", "total_s")))
    start = time.perf_counter()
    tpattn.run_matrix()
    print(f"run_matrix() in-process: {time.perf_counter() - start:.3f} s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="timed runs of each (default: %(default)s)")
    ap.add_argument("--smoke", action="store_true",
                    help="one small run_distributed and run_matrix: checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        return smoke()
    runs = args.runs

    print(f"End to end: a fresh process prints the 15-case matrix ({runs} alternating runs, median)")
    times = end_to_end(runs)
    base = statistics.median(times[BASELINE])
    width = max(map(len, times))
    print(f"  {'command':<{width}}  median s    min s    max s   vs simulated")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"  {name:<{width}}  {med:8.2f} {min(values):8.2f} {max(values):8.2f}   {med / base:6.2f}x")
    ratio = statistics.median(times["python -m tpattn.distributed (2 ranks)"]) / base
    print(f"  target: 2 real ranks <= 3x the simulated matrix end to end -> {ratio:.2f}x "
          f"({'met' if ratio <= 3 else 'NOT met'})")

    print(f"\nWhere the time goes, in one Python process ({runs} runs, median)")
    rows = in_process(runs)
    width = max(map(len, rows))
    for name, values in rows.items():
        print(f"  {name:<{width}}  {statistics.median(values):8.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
