"""Headroom of ``tolerance="auto"`` under this machine's kernels: a distribution, not one number.

Runs correct TP and both bugs (``tpattn.check.at_scale.compare_world_sizes``, conditioning probe
always on) and prints, for correct TP, the distribution of ``max_m measure_m / bound_m``
(headroom of the calibrated ``C = 1``) and of ``measure / floor``, the verdict counts of every
mode, and every false "fail" of correct TP (there must be none) or "pass" of a bug.

Cases (``--block``):

- ``llama``: the Llama-3-8B attention shape (hidden 4096, 32/8 heads of 128), seq 64, batch 1,
  world sizes 2, 4, 8, ``--seeds`` (default 1-5), float32 and bfloat16, inits seed and
  fan_in. Seed 2 (the issue's command) is the case the floor was designed on; the other
  seeds are held out and reported apart.
- ``shapes``: held-out random small shapes (hidden 16-256, world sizes 1-8), all three dtypes,
  both inits, seeds 1000-1000+N.

Kernel settings (``--setting``; the process re-executes itself with that environment, since
ATen and MKL read it at start-up): ``default`` (the machine's own kernels and threads),
``default-1t`` (the same on one thread), ``sse42`` (``ATEN_CPU_CAPABILITY=default
MKL_ENABLE_INSTRUCTIONS=SSE4_2``), ``avx2`` (``ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2``), ``cbwr`` (``MKL_CBWR=COMPATIBLE``); all but ``default`` on
one thread. Each run appends one JSON line per unit (one shape x dtype x init, or one
Llama seed x dtype x init) to ``--rows`` and skips units already there, so an interrupted
or ``--budget-s``-limited run resumes where it stopped::

    nice -n 10 python bench/tolerance_headroom.py --setting sse42 --rows sse42.jsonl

and the runs are joined into the chapter's table (book/data/tolerance_headroom.json,
committed; chapter 14 reads it), with the CPU named and, per setting and group, the count of
correct-TP runs, the quantiles of measure/bound and measure/floor, and the verdicts
(``table``: by block, dtype and init; ``blocks``: by block alone)::

    python bench/tolerance_headroom.py --merge default.jsonl sse42.jsonl ... --out PATH

``--smoke``: one unit alone (the first held-out shape with two or more ranks, float32, the
seed's init), in this process's kernel setting, nothing written (seconds).

Usage: python bench/tolerance_headroom.py --setting NAME --rows PATH [--block ...]
                                          [--seeds 2 1 3 4 5] [--shapes N] [--budget-s S]
       python bench/tolerance_headroom.py --smoke
       python bench/tolerance_headroom.py --merge A.jsonl ... [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import time

import torch

import tpattn
from tpattn import Config
from tpattn.bugs.modes import resolve_all
from tpattn.check.at_scale import compare_world_sizes, llama3_8b_attention
from tpattn.check.core import EQUIVALENCE
from tpattn.check.tolerance import VERDICTS

DESIGN_SEEDS = (2,)
SETTINGS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "OMP_NUM_THREADS")
#: The kernel settings by name: the environment each run is executed in.
SETTING_ENVS = {
    "default": {},
    "default-1t": {"OMP_NUM_THREADS": "1"},
    "sse42": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
              "OMP_NUM_THREADS": "1"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "OMP_NUM_THREADS": "1"},
    "cbwr": {"MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"},
}


def llama_unit(seed: int, dtype: str, init: str) -> list[dict]:
    """Correct TP and both bugs at the Llama shape, TP 2/4/8, one seed x dtype x init."""
    cfg = llama3_8b_attention(64, dtype)
    return [dict(r, block="llama", held_out=seed not in DESIGN_SEEDS, shape="llama seq64")
            for r in compare_world_sizes(cfg, seed, resolve_all(tpattn.MODES),
                                         world_sizes=(2, 4, 8), init=init, probe=True)]


def random_shapes(n: int, rng: random.Random) -> list[Config]:
    shapes = []
    while len(shapes) < n:
        kv = rng.choice((2, 4, 8))
        w = rng.choice([w for w in (1, 2, 4, 8) if kv % w == 0])
        group = rng.choice((1, 2, 4))
        d = rng.choice((4, 8, 16, 32))
        shapes.append(Config(seq=rng.choice((4, 8, 16)), batch=rng.choice((1, 2)),
                             hidden=rng.choice((16, 64, 128, 256)), query_heads=kv * group,
                             kv_heads=kv, head_dim=d, world_size=w))
    return shapes


def shape_unit(i: int, cfg: Config, dtype: str, init: str) -> list[dict]:
    """Correct TP and both bugs at held-out random shape ``i`` (seed 1000 + i)."""
    c = Config(**{**cfg.as_dict(), "dtype": dtype})
    return [dict(r, block="shapes", held_out=True,
                 shape=f"h{c.hidden} s{c.seq} b{c.batch} {c.query_heads}/"
                       f"{c.kv_heads}x{c.head_dim} w{c.world_size}")
            for r in compare_world_sizes(c, 1000 + i, resolve_all(tpattn.MODES),
                                         world_sizes=(c.world_size,), init=init, probe=True)]


def units(block: str, seeds, n_shapes: int):
    """``(key, thunk)`` for every unit, cheap ones first: the shapes, then the Llama shape
    seed by seed (in ``seeds``' order: the design seed first by default), float32 first."""
    if block in ("shapes", "both"):
        for i, cfg in enumerate(random_shapes(n_shapes, random.Random(22))):
            for dtype in ("float32", "float64", "bfloat16"):
                for init in ("seed", "fan_in"):
                    yield (f"shape {i} {dtype} {init}",
                           lambda i=i, cfg=cfg, d=dtype, n=init: shape_unit(i, cfg, d, n))
    if block in ("llama", "both"):
        for seed in seeds:
            for dtype in ("float32", "bfloat16"):
                for init in ("fan_in", "seed"):
                    yield (f"llama {seed} {dtype} {init}",
                           lambda s=seed, d=dtype, n=init: llama_unit(s, d, n))


def quantile(xs, q: float) -> float:
    """The ``q``-quantile of ``xs`` (linear between order statistics)."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def compact(row: dict) -> dict:
    """What the table needs of one TP step: who, the verdict, and the largest ratios."""
    return {"block": row["block"], "held_out": row["held_out"], "shape": row["shape"],
            "dtype": row["dtype"], "init": row["init"], "world_size": row["world_size"],
            "mode": row["mode"], "seed": row["seed"], "verdict": row["verdict"],
            "over_bound": max(row["ratios"].values()),
            "over_floor": max(row["floor_ratios"].values()),
            "amplification": max(row["amplification_by"].values()),
            "worst_parameter": row["worst_parameter"]["parameter_grad_max_abs_diff"]}


GROUP = ("block", "held_out", "dtype", "init")


def summarise(rows: list[dict], keys=GROUP) -> list[dict]:
    """Per group of ``keys`` (default: block, design/held-out, dtype, init): the
    distribution of correct TP's measure/bound (median, p95, max) and its largest
    measure/floor, the largest amplification, the smallest bug measure/bound, and the
    verdict counts of correct TP and of the bugs."""
    table = []
    for key in sorted({tuple(r[k] for k in keys) for r in rows}):
        sel = [r for r in rows if tuple(r[k] for k in keys) == key]
        ok = [r for r in sel if r["mode"] == EQUIVALENCE]
        bugs = [r for r in sel if r["mode"] != EQUIVALENCE]
        head = [r["over_bound"] for r in ok]
        table.append({
            **dict(zip(keys, key)), "n_correct": len(ok), "n_bugs": len(bugs),
            "median_over_bound": quantile(head, 0.5) if head else None,
            "p95_over_bound": quantile(head, 0.95) if head else None,
            "max_over_bound": max(head) if head else None,
            "max_over_floor": max((r["over_floor"] for r in ok), default=None),
            "max_amplification": max(r["amplification"] for r in sel),
            "min_bug_over_bound": min((r["over_bound"] for r in bugs), default=None),
            "correct": {v: sum(r["verdict"] == v for r in ok) for v in VERDICTS},
            "bugs": {v: sum(r["verdict"] == v for r in bugs) for v in VERDICTS}})
    return table


def report(rows: list[dict]) -> None:
    """Print the table of ``summarise`` and every false "fail" or bug "pass"."""
    for g in summarise(rows):
        print(f"{g['block']} {'held-out' if g['held_out'] else 'design'} {g['dtype']} "
              f"init={g['init']}: correct TP n={g['n_correct']} measure/bound median "
              f"{g['median_over_bound']:.3g} p95 {g['p95_over_bound']:.3g} max "
              f"{g['max_over_bound']:.3g}; A <= {g['max_amplification']:.3g}; correct "
              f"{g['correct']} bugs {g['bugs']}")
    bad = [r for r in rows if (r["verdict"] == "fail") == (r["mode"] == EQUIVALENCE)
           and r["verdict"] != "inconclusive"]
    n_ok = sum(r["mode"] == EQUIVALENCE for r in rows)
    over = sum(r["mode"] == EQUIVALENCE and r["over_bound"] > 1 for r in rows)
    # 0 of n over the bound: P(over) < 3/n at 95% confidence (the rule of three).
    print(f"correct TP over the C=1 bound: {over}/{n_ok}"
          + (f" (95% upper bound {3 / n_ok:.3g}, rule of three)" if n_ok and not over else "")
          + " on these cases and kernels")
    for r in bad:
        print("  !", r["shape"], r["dtype"], r["init"], r["world_size"], r["mode"],
              r["seed"], r["verdict"])


OUT = pathlib.Path(__file__).resolve().parent.parent / "book" / "data" / "tolerance_headroom.json"


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def read_rows(path) -> tuple[dict, list[dict]]:
    """``(header, rows)`` of one ``--rows`` file: its first line's setting, every unit's rows."""
    header, rows = {}, []
    for line in pathlib.Path(path).read_text().splitlines():
        d = json.loads(line)
        if "unit" in d:
            rows += d["rows"]
        else:
            header = d
    return header, rows


def merge(paths, out) -> None:
    """One table from several settings' ``--rows`` files, written to ``out``."""
    table, blocks = [], []
    for p in paths:
        header, rows = read_rows(p)
        env = " ".join(f"{k}={v}" for k, v in header["env"].items()) or "default"
        who = {"setting": env, "name": header["setting"], "kernels": header["kernels"],
               "threads": header["threads"]}
        table += [dict(who, **g) for g in summarise(rows)]
        blocks += [dict(who, **g) for g in summarise(rows, ("block", "held_out"))]
    pathlib.Path(out).write_text(json.dumps(
        {"cpu": cpu_model(), "torch": torch.__version__, "blocks": blocks, "table": table},
        indent=1) + "\n")
    print(f"wrote {out}: {len(table)} rows")


def smoke(n_shapes: int) -> None:
    """The first held-out shape with two or more ranks, float32, the seed's init: its report."""
    shapes = random_shapes(n_shapes, random.Random(22))
    i = next(i for i, cfg in enumerate(shapes) if cfg.world_size > 1)
    print(f"smoke: shape {i} float32 seed, kernels {torch.backends.cpu.get_cpu_capability()} "
          f"threads {torch.get_num_threads()}")
    report([compact(r) for r in shape_unit(i, shapes[i], "float32", "seed")])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", choices=tuple(SETTING_ENVS), default="default")
    ap.add_argument("--rows", help="JSON lines to append to and resume from")
    ap.add_argument("--block", choices=("llama", "shapes", "both"), default="both")
    ap.add_argument("--seeds", type=int, nargs="+", default=[2, 1, 3, 4, 5])
    ap.add_argument("--shapes", type=int, default=12)
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="start no new unit after this many seconds")
    ap.add_argument("--merge", nargs="+", metavar="JSONL")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--smoke", action="store_true",
                    help="the first unit alone, nothing written: checks the script runs")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    if args.smoke:
        return smoke(args.shapes)
    env = SETTING_ENVS[args.setting]
    current = {k: os.environ[k] for k in SETTINGS if k in os.environ}
    if current != env:  # ATen and MKL read these at start-up: run again under them
        clean = {k: v for k, v in os.environ.items() if k not in SETTINGS}
        os.execve(sys.executable, [sys.executable, *sys.argv], {**clean, **env})
    kernels, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    print(f"setting {args.setting}: kernels {kernels} threads {threads} env {env}", flush=True)
    done, rows = set(), []
    path = pathlib.Path(args.rows) if args.rows else None
    if path and path.exists():
        header, _ = read_rows(path)
        if header.get("env") != env:
            raise SystemExit(f"{path} holds setting {header.get('setting')!r}, not "
                             f"{args.setting!r}")
        for line in path.read_text().splitlines():
            d = json.loads(line)
            if "unit" in d:
                done.add(d["unit"])
                rows += d["rows"]
    elif path:
        path.write_text(json.dumps({"setting": args.setting, "env": env, "kernels": kernels,
                                    "threads": threads, "torch": torch.__version__}) + "\n")
    t0 = time.perf_counter()
    for key, thunk in units(args.block, args.seeds, args.shapes):
        if key in done:
            continue
        if time.perf_counter() - t0 > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: stopping before {key}")
            break
        t = time.perf_counter()
        unit_rows = [compact(r) for r in thunk()]
        rows += unit_rows
        if path:
            with path.open("a") as f:
                f.write(json.dumps({"unit": key, "rows": unit_rows}) + "\n")
        print(f"  {key}: {''.join(r['verdict'][0] for r in unit_rows)} "
              f"({time.perf_counter() - t:.1f} s)", flush=True)
    report(rows)
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
