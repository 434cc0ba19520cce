"""Update latency of the seed × mode explorer, driven in-process as a reader would drive it.

Each update sets one control (the seed or the mode, alternating, seeds both from the fixture
and fresh ones) and times until the output area holds the new measures and bars — the
``run`` through the package, the table, the PNG — plus serializing the output area's state
as the kernel does before sending it to the frontend. Target: p95 <= 50 ms at the default
Config. Prints p50/p95/max of the wall-clock latency and of the process's CPU time per update
(on a machine busy with other work the two differ); exit status 0 either way (a timing, not a
test).

    .venv/bin/python bench/widget_latency.py [--updates 60]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from ipywidgets.widgets.widget import _remove_buffers

import tpattn
from tpattn import widgets

TARGET_P95_MS = 50.0


def percentile(values, q):
    """The ``q``-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=60, help="number of updates (>= 50)")
    args = parser.parse_args()
    if args.updates < 50:
        parser.error("--updates must be >= 50 (got %d)" % args.updates)

    explorer = widgets.seed_mode_explorer()          # the first draw builds the figure
    rng = random.Random(0)
    seeds = list(tpattn.SEEDS) + [rng.randrange(0, 10**6) for _ in range(20)]
    latencies, cpu_times, run_times = [], [], []
    for i in range(args.updates):
        seed, mode = explorer.values["seed"], explorer.values["mode"]
        if i % 2:
            change = {"mode": rng.choice([m for m in tpattn.MODES if m != mode])}
        else:
            change = {"seed": rng.choice([s for s in seeds if s != seed])}
        before = explorer.redraws
        start, cpu_start = time.perf_counter(), time.process_time()
        name, value = next(iter(change.items()))
        explorer.controls[name].value = value         # observe → redraw, as from the frontend
        state, _, _ = _remove_buffers(explorer.output.get_state("outputs"))
        json.dumps(state)                             # what the kernel sends
        latencies.append(1e3 * (time.perf_counter() - start))
        cpu_times.append(1e3 * (time.process_time() - cpu_start))
        assert explorer.redraws == before + 1, "the output area was not redrawn"
        text = explorer.output.outputs[0]["data"]["text/plain"]
        assert str(explorer.values["seed"]) in text and explorer.values["mode"] in text, text

        t0 = time.perf_counter()                      # the package's share of it
        with widgets.core.single_thread():
            tpattn.run(explorer.values["seed"], explorer.values["mode"])
        run_times.append(1e3 * (time.perf_counter() - t0))

    p50, p95 = statistics.median(latencies), percentile(latencies, 95)
    print(f"seed x mode explorer, default Config, {len(latencies)} updates "
          f"(seed and mode alternating)")
    print(f"  update latency  p50 {p50:6.1f} ms   p95 {p95:6.1f} ms   max {max(latencies):6.1f} ms")
    print(f"  CPU time        p50 {statistics.median(cpu_times):6.1f} ms   "
          f"p95 {percentile(cpu_times, 95):6.1f} ms   (wall minus waiting for a busy CPU)")
    print(f"  of which run()  p50 {statistics.median(run_times):6.1f} ms   "
          f"p95 {percentile(run_times, 95):6.1f} ms")
    print(f"  full figure draws: {explorer.plot.full_draws} (the rest redraw bars and labels)")
    verdict = "met" if p95 <= TARGET_P95_MS else "NOT met"
    print(f"  target p95 <= {TARGET_P95_MS:.0f} ms: {verdict}")


if __name__ == "__main__":
    main()
