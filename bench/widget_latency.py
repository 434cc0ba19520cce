"""Update latency of every live explorer, driven in-process as a reader would drive it —
before and after a change, in one run.

Each explorer is built at its default state (the arguments its chapter uses); then each update
sets one control through its real widget (``control.value = ...``, which fires the observer as
a change from the frontend does) and times until the output area holds the new content — the
package's computation, the text, the PNG or SVG — plus serializing the output area's state as
the kernel does before sending it to the frontend. The changed control and its new value are
drawn from a fixed random sequence of values a reader can pick (slider positions, toggle
buttons, seeds from the fixture and fresh ones, head counts, some of them invalid). Every
update counts, the first draw of each layout included; an update that only shows a message
(an invalid layout: ``Config``'s message) is counted apart and left out of the percentiles,
which are over redraws alone.

Target (issue 27): per explorer, redraw p95 <= 50 ms and worst <= 100 ms, wall and CPU (a
response under ~100 ms feels instant). Prints per explorer p50/p95/max of the wall-clock
latency and of the process's CPU time per redraw (on a machine busy with other work the two
differ; CPU time is the less load-sensitive), the messages' worst, the CPU time of the cell
that builds and displays the explorer (its first draw and static twin), PASS/OVER, and the
load average (1 minute) when the row ended, with ``uptime`` before and after. ``--before
REV`` (default ``b42a997``, main before the explorers' static twins became their live draw;
``dbfbace`` is the tree before issue 27) first times the package of git revision REV
(extracted to a temporary directory, run in a subprocess), then the working tree's;
``--before ''`` times the working tree only. ``--json PATH``
writes the working tree's figures. Exit status 0 either way (a timing, not a test).

    .venv/bin/python bench/widget_latency.py [--updates 60] [--only rope,kv] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import tpattn
from tpattn import widgets
from tpattn.check.core import SP_MODES
from tpattn.widgets.bug_hunt import bug_hunt_explorer

TARGET_P95_MS = 50.0
TARGET_MAX_MS = 100.0


def percentile(values, q):
    """The ``q``-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def uptime() -> str:
    """The ``uptime`` line (the load averages over 1, 5 and 15 minutes)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _other(rng: random.Random, options, current):
    return rng.choice([o for o in options if o != current])


def _seeds(rng: random.Random) -> list[int]:
    return list(tpattn.SEEDS) + [rng.randrange(0, 10**6) for _ in range(20)]


# Each explorer: how to build it at its default state, and which (control, value) a reader
# changes next, given the rng and the explorer's current values.
Change = Callable[[random.Random, dict], tuple[str, object]]


def _rope_change(rng, values):
    if rng.random() < 0.7:
        return "position", _other(rng, range(0, 17), values["position"])
    return "head_dim", _other(rng, [2, 4, 8, 16, 32], values["head_dim"])


def _attention_change(rng, values, seeds):
    pick = rng.random()
    if pick < 0.4:
        return "heads", _other(rng, list(widgets.ATTENTION_LAYOUTS), values["heads"])
    if pick < 0.8:
        return "seed", _other(rng, seeds, values["seed"])
    return "batch_index", _other(rng, [0, 1], values["batch_index"])


def _layout_change(rng, values):
    name = rng.choice(["query_heads", "kv_heads", "world_size"])
    options = {"query_heads": [2, 4, 6, 8, 16], "kv_heads": [1, 2, 4, 8],
               "world_size": [1, 2, 3, 4, 8]}[name]
    return name, _other(rng, options, values[name])


def _kv_change(rng, values):
    if rng.random() < 0.25:
        return "kv_strategy", _other(rng, list(tpattn.config.KV_STRATEGIES), values["kv_strategy"])
    return _layout_change(rng, values)


def _seed_mode_change(modes):
    def change(rng, values, seeds):
        if rng.random() < 0.5:
            return "mode", _other(rng, list(modes), values["mode"])
        return "seed", _other(rng, seeds, values["seed"])
    return change


def _bug_hunt_change(rng, values):
    from tpattn.widgets.bug_hunt import UNANSWERED
    from tpattn.diagnosis.hunt import choices

    if rng.random() < 0.5:
        return "hunt", _other(rng, range(0, 30), values["hunt"])
    return "guess", _other(rng, [UNANSWERED] + choices(), values["guess"])


def explorers(rng: random.Random) -> dict[str, tuple[Callable, Change]]:
    """name → (build at the chapter's default state, next change)."""
    seeds = _seeds(rng)
    return {
        "rope (ch 3)": (lambda: widgets.rope_explorer(position=3, head_dim=8), _rope_change),
        "attention (ch 4)": (lambda: widgets.attention_explorer(seed=11, heads="GQA 4q/2kv"),
                             lambda r, v: _attention_change(r, v, seeds)),
        "sharding (ch 6)": (lambda: widgets.sharding_explorer(4, 2, 2), _layout_change),
        "seed x mode (ch 8-10)": (widgets.seed_mode_explorer,
                                  lambda r, v: _seed_mode_change(tpattn.MODES)(r, v, seeds)),
        "seed x SP mode (ch 12)": (widgets.sp_explorer,
                                   lambda r, v: _seed_mode_change(SP_MODES)(r, v, seeds)),
        "kv (ch 13)": (lambda: widgets.kv_explorer(query_heads=8, kv_heads=2, world_size=4),
                       _kv_change),
        "bug hunt (ch 17)": (lambda: bug_hunt_explorer(hunt=2), _bug_hunt_change),
    }


def time_explorer(build: Callable, change: Change, updates: int, rng: random.Random) -> dict:
    """Latency and CPU time (ms) of ``updates`` one-control changes of ``build()``."""
    cell_start = time.process_time()
    explorer = build()  # the cell's run, not timed as an update: the first draw and the
    explorer._repr_mimebundle_()  # display (the static twin), as the notebook shows it
    cell_cpu_s = time.process_time() - cell_start
    latencies, cpu_times, message_ms = [], [], []
    for _ in range(updates):
        name, value = change(rng, explorer.values)
        before = explorer.redraws
        start, cpu_start = time.perf_counter(), time.process_time()
        explorer.controls[name].value = value         # observe → redraw, as from the frontend
        json.dumps(explorer.output.get_state("outputs"))  # what the kernel sends (no buffers)
        wall, cpu = 1e3 * (time.perf_counter() - start), 1e3 * (time.process_time() - cpu_start)
        assert explorer.redraws == before + 1, "the output area was not redrawn"
        assert explorer.values[name] == value, (name, value)
        outputs = explorer.output.outputs
        assert outputs, "the output area is empty"
        if "tpx-message" in outputs[0]["data"].get("text/html", ""):
            message_ms.append(wall)
        else:
            latencies.append(wall)
            cpu_times.append(cpu)
    return {
        "updates": updates, "messages": len(message_ms), "cell_cpu_s": cell_cpu_s,
        "message_wall_max_ms": max(message_ms, default=0.0),
        "wall_ms": {"p50": statistics.median(latencies), "p95": percentile(latencies, 95),
                    "max": max(latencies)},
        "cpu_ms": {"p50": statistics.median(cpu_times), "p95": percentile(cpu_times, 95),
                   "max": max(cpu_times)},
    }


def verdict(figures: dict) -> str:
    """PASS when p95 <= TARGET_P95_MS and max <= TARGET_MAX_MS, else OVER."""
    return "PASS" if (figures["p95"] <= TARGET_P95_MS
                      and figures["max"] <= TARGET_MAX_MS) else "OVER"


def time_tree(args) -> dict:
    """Time the explorers of the ``tpattn`` this process imports; print one row each."""
    rng = random.Random(0)
    chosen = {name: spec for name, spec in explorers(rng).items()
              if not args.only or any(name.startswith(p) for p in args.only.split(","))}
    print(f"{'explorer':24} {'wall p50':>8} {'p95':>6} {'max':>6}   "
          f"{'CPU p50':>7} {'p95':>6} {'max':>6}  {'cell CPU':>8}  load  verdict (wall, CPU)")
    results = {}
    for name, (build, change) in chosen.items():
        r = results[name] = time_explorer(build, change, args.updates, random.Random(name))
        w, c = r["wall_ms"], r["cpu_ms"]
        note = (f"  + {r['messages']} messages, worst {r['message_wall_max_ms']:.1f} ms"
                if r["messages"] else "")
        r["verdict"], r["cpu_verdict"], r["load"] = verdict(w), verdict(c), os.getloadavg()[0]
        print(f"{name:24} {w['p50']:8.1f} {w['p95']:6.1f} {w['max']:6.1f}   "
              f"{c['p50']:7.1f} {c['p95']:6.1f} {c['max']:6.1f}  {r['cell_cpu_s']:7.2f}s  "
              f"{r['load']:4.1f}  {r['verdict']}, {r['cpu_verdict']}{note}", flush=True)
    return results


def time_revision(rev: str, args) -> None:
    """Run this script on the package of git revision ``rev`` (in a subprocess)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(["git", "-C", str(root), "archive", rev, "tpattn"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        env = {**os.environ, "PYTHONPATH": tree}
        subprocess.run([sys.executable, __file__, "--before", "", "--updates", str(args.updates),
                        "--only", args.only], env=env, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=60, help="updates per explorer (>= 50)")
    parser.add_argument("--only", default="", help="comma-separated name prefixes to time")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--before", default="b42a997", metavar="REV",
                        help="git revision to time first ('' for none)")
    args = parser.parse_args()
    if args.updates < 50:
        parser.error("--updates must be >= 50 (got %d)" % args.updates)
    print(f"redraw latency per live explorer, {args.updates} one-control updates each, target "
          f"p95 <= {TARGET_P95_MS:.0f} ms and max <= {TARGET_MAX_MS:.0f} ms; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    print("uptime:", uptime(), flush=True)
    if args.before:
        print(f"before: tpattn of {args.before}", flush=True)
        time_revision(args.before, args)
        print("after: tpattn of", pathlib.Path(tpattn.__file__).parent, flush=True)
    results = time_tree(args)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}; uptime: {uptime()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target_p95_ms": TARGET_P95_MS, "target_max_ms": TARGET_MAX_MS,
                       "updates": args.updates, "explorers": results}, f, indent=2)


if __name__ == "__main__":
    main()
    sys.exit(0)
