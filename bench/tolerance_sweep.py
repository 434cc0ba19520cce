"""The sweep behind chapter 14 ("Equal at scale"): correct TP and both bugs against the
``tolerance="auto"`` bounds at the Llama-3-8B attention shape.

Cases (``tpattn.check.at_scale``; rank-batched TP path; dense computed once per seed and dtype):

- float32, float64, bfloat16 x TP 1/2/4/8 x all modes x seeds 1-2, seq 64, 1/sqrt(fan_in) init;
- float32 at seq 256, TP 8, seeds 1-2 (the bench's shape);
- float32 with the seed's 0.15 init, seq 64, TP 8 (saturated softmax), seeds 1-2;
- bfloat16 and float32 dense against float64 dense of the same numbers, seeds 1-2.

Writes ``--out`` (default ``_build/bench/equal_at_scale.json``, not committed); the chapter
reads ``book/data/equal_at_scale.json`` (committed; it re-runs one case itself): pass
``--out book/data/equal_at_scale.json`` to replace that. ~10 minutes on 2 idle cores,
bfloat16 being most of it (CPU bf16 kernels are slow). Prints, per dtype, correct TP's
largest measure/bound and the bugs' smallest.

The committed JSON (2026-12-01, a 2-core machine shared by several jobs, load 12-20):
the float32 and float64 blocks of seeds 1 and 2 (two runs, ``--seeds 1`` and ``--seeds 2``,
joined with ``--merge``). Both runs were stopped inside their bfloat16 block: on that
loaded machine one bfloat16 block did not finish in 30 minutes, so the seq-256, 0.15-init
and float64-reference blocks are not in it either. Chapter 14 runs bfloat16 live at a
smaller width instead; run the full sweep on an idle machine to fill them in.

``--smoke``: TP 1 and 2 at the fixture's shape (``Config()``), float32, seed 1, and its dense
step against float64; writes nothing unless ``--out`` is given (seconds).

Usage: python bench/tolerance_sweep.py [--out PATH] [--seeds 1 2] [--smoke]
       python bench/tolerance_sweep.py --merge A.json B.json [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

import torch

import tpattn
from tpattn import Config
from tpattn.bugs.modes import resolve_all
from tpattn.check.at_scale import against_float64, compare_world_sizes, llama3_8b_attention

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "_build" / "bench" / "equal_at_scale.json"


def summary(rows: list[dict]) -> None:
    """Per dtype: correct TP's largest measure/bound and the bugs' smallest (every world size)."""
    for dtype in sorted({r["dtype"] for r in rows}):
        of = [r for r in rows if r["dtype"] == dtype]
        ok = [max(r["ratios"].values()) for r in of if r["mode"] == tpattn.EQUIVALENCE]
        bugs = [max(r["ratios"].values()) for r in of if r["mode"] != tpattn.EQUIVALENCE]
        nan = float("nan")
        print(f"{dtype}: {len(of)} TP steps; correct TP measure/bound max "
              f"{max(ok, default=nan):.3g}, bugs min {min(bugs, default=nan):.3g}")


def smoke(out: str | None) -> None:
    """TP 1 and 2 at ``Config()``, float32, seed 1; dense against float64 (see the doc)."""
    cfg = Config()
    rows = compare_world_sizes(cfg, 1, resolve_all(tpattn.MODES), world_sizes=(1, 2))
    summary(rows)
    row = against_float64(cfg, 1)
    print(f"float32 dense against float64: measure/bound max {max(row['ratios'].values()):.3g}")
    if out:
        pathlib.Path(out).write_text(json.dumps(
            {"torch": torch.__version__, "machine": platform.machine(), "seconds": 0.0,
             "tp_vs_dense": rows, "dense_vs_float64": [row]}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help=f"where to write the JSON (default: {OUT})")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="join the rows of earlier sweeps' JSON files into --out, run nothing")
    ap.add_argument("--smoke", action="store_true",
                    help="TP 1 and 2 at the fixture's shape: checks the script runs, in seconds")
    args = ap.parse_args()
    if args.smoke:
        return smoke(args.out)
    args.out = args.out or str(OUT)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.merge:
        parts = [json.loads(pathlib.Path(p).read_text()) for p in args.merge]
        merged = {"torch": parts[0]["torch"], "machine": parts[0]["machine"],
                  "seconds": sum(p["seconds"] for p in parts),
                  "tp_vs_dense": [r for p in parts for r in p["tp_vs_dense"]],
                  "dense_vs_float64": [r for p in parts for r in p["dense_vs_float64"]]}
        pathlib.Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
        print(f"wrote {args.out}: {len(merged['tp_vs_dense'])} TP steps")
        return
    torch.set_num_threads(2)
    programs = resolve_all(tpattn.MODES)
    t0 = time.perf_counter()
    out = {"torch": torch.__version__, "machine": platform.machine(), "seconds": 0.0,
           "tp_vs_dense": [], "dense_vs_float64": []}

    def save(what: str) -> None:  # after every block, so an interrupted sweep keeps its rows
        out["seconds"] = time.perf_counter() - t0
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"{what} done at {out['seconds']:.0f} s", flush=True)

    for seed in args.seeds:
        for dtype in ("float32", "float64", "bfloat16"):
            out["tp_vs_dense"] += [dict(r, seq=64) for r in compare_world_sizes(
                llama3_8b_attention(64, dtype), seed, programs)]
            save(f"seed {seed} {dtype}")
        out["tp_vs_dense"] += [dict(r, seq=256) for r in compare_world_sizes(
            llama3_8b_attention(256, "float32"), seed, programs, world_sizes=(8,))]
        out["tp_vs_dense"] += [dict(r, seq=64) for r in compare_world_sizes(
            llama3_8b_attention(64, "float32"), seed, programs, world_sizes=(8,), init="seed")]
        for dtype in ("float32", "bfloat16"):
            out["dense_vs_float64"].append(
                dict(against_float64(llama3_8b_attention(64, dtype), seed), seq=64))
        save(f"seed {seed} seq 256, 0.15 init, float64 references")
    summary(out["tp_vs_dense"])
    print(f"wrote {args.out}: {len(out['tp_vs_dense'])} TP steps")


if __name__ == "__main__":
    main()
