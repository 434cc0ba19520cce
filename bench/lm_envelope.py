"""Rounding or a bug, at step N: correct TP and every training-changing mode of the LM's
registry (``LM_REGISTRY``), judged against a rounding envelope (``tpattn.bugs.lm_curves``),
float32 and bfloat16.

Per case (a seed, an LM shape and a dtype) the dense run and ``K`` dense twins one rounding away
(each step's gradient rounding error, against float64, sign-flipped at random) are trained for
``N`` SGD steps on the same random token batches; the envelope is their largest relative weight
distance per step. Then, at world sizes 2 and 4, correct TP (its largest divergence / envelope
ratio and the verdict) and every other mode of ``LM_REGISTRY`` (each through
``lm_zoo.lm_case``: a new registry entry joins the table by itself): the step where it
leaves margin x envelope. At W = 2 also ``g`` after the MLP times ``1 + delta`` (``SCALES``):
the envelope's detection limit. Below float32 each verdict is completed by the float32 replay
of the same steps (``tpattn.model.envelope.replayed``): a systematic error below bfloat16's
rounding shows there.

The TUNE cases chose ``MARGIN`` and ``K``; the HELD_OUT cases (seeds and shapes not run while
tuning) are reported apart. The cost line compares the envelope's runs x steps with a plain
TP=1 comparison (one dense run); each twin step also takes a float64 gradient.

Measured (2026-12-03, 2 shared cores, one thread, ~12 min, the registry's ten bugs): correct
TP's largest divergence/envelope 1.85 tuned, 1.21 held out; float32 always "rounding";
bfloat16 "rounding" or "rounding through step s, inconclusive after" (s >= 27), never "bug".
Every bug "bug" in every run (80/80 tuned, 80/80 held out), from step 1 except local label
smoothing in bfloat16 (steps 1-15; 3 of its 16 bfloat16 runs stay inside the bfloat16
envelope and are caught by the float32 replay from step 1). Detection limit of g x (1 +
delta): float32 delta 1e-5 always; bfloat16 alone 0.3 always, with the replay 0.03.

Usage: python bench/lm_envelope.py [--only tune|held_out] [--steps-f32 N] [--steps-bf16 N]
       python bench/lm_envelope.py --smoke
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from tpattn.bugs.lm_curves import (CURVE_LR as LR, K, MARGIN, reference_for,
                                   training_modes)
from tpattn.bugs.lm_zoo import LM_EQUIVALENCE, lm_case
from tpattn.config import Config
from tpattn.model.config import LMConfig
from tpattn.model.envelope import judge_curves, make_batches, replayed
from tpattn.model.params import init_lm_params
from tpattn.model.tp import LM_CORRECT
from tpattn.parallel.collectives import ReduceFromRanks

#: Held out first, before any tuning run: seeds and shapes the tuning never saw.
HELD_OUT = [
    {"seed": 101, "lm": {"vocab": 48, "layers": 3, "ffn": 40},
     "block": {"hidden": 24, "query_heads": 4, "kv_heads": 2, "head_dim": 6, "seq": 6,
               "batch": 3}},
    {"seed": 202, "lm": {"vocab": 64, "layers": 1, "ffn": 64, "tied": True},
     "block": {"hidden": 32, "query_heads": 8, "kv_heads": 4, "head_dim": 4, "seq": 4,
               "batch": 2}},
]
#: The cases the margin and K were chosen on.
TUNE = [
    {"seed": 1, "lm": {}, "block": {}},
    {"seed": 2, "lm": {"vocab": 32, "layers": 2, "ffn": 32},
     "block": {"hidden": 16, "query_heads": 4, "kv_heads": 1, "head_dim": 4, "seq": 8,
               "batch": 2}},
]
DTYPES = {"float32": 100, "bfloat16": 50}
#: The detection limit: g after the MLP times (1 + delta), at W = 2, per dtype.
SCALES = {"float32": (1e-6, 3e-6, 1e-5), "bfloat16": (0.03, 0.1, 0.3)}


def scaled_g(delta: float):
    """g after the MLP, its sum times ``1 + delta``: a small systematic error."""
    def g(t, comm, label=None):
        return ReduceFromRanks.apply(t, comm, label) * (1 + delta)
    return g


def programs(lm: LMConfig) -> dict:
    """name -> (lm, program): correct TP, every training-changing registry mode (through
    ``lm_case``), and at world size 2 the scaled g's of ``SCALES``."""
    cases = {m: lm_case(m, lm)[:2] for m in [LM_EQUIVALENCE] + training_modes()}
    if lm.block.world_size == 2:
        cases.update({f"g after the MLP x (1 + {d:g})":
                      (lm, replace(LM_CORRECT, mlp_g=scaled_g(d))) for d in SCALES[lm.block.dtype]})
    return cases


def make_lm(case: dict, world_size: int, dtype: str) -> LMConfig:
    """The case's LM at ``world_size`` in ``dtype``."""
    return LMConfig(block=Config(world_size=world_size, dtype=dtype, **case["block"]),
                    **case["lm"])


def judge_one(lm: LMConfig, prog, seed: int, steps: int) -> dict:
    """One judged run: its row (verdict, largest ratio, step left, seconds); below float32 the
    verdict is completed by the float32 replay of the same steps (``replayed``), and
    ``alone`` keeps the low-precision envelope's own."""
    t0 = time.perf_counter()
    reference = reference_for(lm, prog.clip, seed, steps)  # remembered per case
    t1 = time.perf_counter()
    out = judge_curves(lm, prog, init_lm_params(lm, seed), make_batches(lm, seed, steps), LR,
                       K, MARGIN, seed, reference)
    tp_s = time.perf_counter() - t1
    alone = out["text"]
    if lm.block.dtype != "float32":
        lm32 = replace(lm, block=replace(lm.block, dtype="float32"))
        t2 = time.perf_counter()
        replay = judge_curves(lm32, prog, init_lm_params(lm32, seed),
                              make_batches(lm32, seed, steps), LR, K, MARGIN, seed,
                              reference_for(lm32, prog.clip, seed, steps))
        out = {**out, **replayed(out, replay)}
        t1 += time.perf_counter() - t2
    return {"max_ratio": float(out["ratio"].max()), "at": int(out["ratio"].argmax()) + 1,
            "kind": out["kind"], "left": out["left"], "through": out["through"],
            "verdict": out["text"], "alone": alone, "envelope_s": t1 - t0, "tp_s": tp_s}


def run_case(case: dict, dtype: str, steps: int) -> list[dict]:
    """One case: correct TP and every mode at world sizes 2 and 4; one row per judged run."""
    rows = []
    for w in (2, 4):
        for name, (lm, prog) in programs(make_lm(case, w, dtype)).items():
            rows.append({"seed": case["seed"], "world_size": w, "program": name,
                         "steps": steps, "dtype": dtype,
                         **judge_one(lm, prog, case["seed"], steps)})
    return rows


def print_rows(title: str, cases: list[dict], dtypes: dict) -> list[dict]:
    """Runs every case in every dtype, prints one line per judged run; returns the rows."""
    print(f"\n## {title}")
    print(f"{'case':>4} {'dtype':>8} {'W':>2} {'program':<34} {'max div/env':>11} "
          f"{'at':>4}  verdict")
    rows = []
    for case in cases:
        for dtype, steps in dtypes.items():
            got = run_case(case, dtype, steps)
            for r in got:
                alone = "" if r["alone"] == r["verdict"] else \
                    f"  [{dtype} alone: {r['alone'].split(' (')[0]}]"
                print(f"{case['seed']:>4} {dtype:>8} {r['world_size']:>2} {r['program']:<34} "
                      f"{r['max_ratio']:>11.3g} {r['at']:>4}  {r['verdict'][:40]}{alone}")
            envelope_s = sum(r["envelope_s"] for r in got)
            tp_s = max(r["tp_s"] for r in got)
            replay = "" if dtype == "float32" else \
                f" + the float32 replay's ({1 + K} x {steps} + {K} x {steps} float64, 1 TP run)"
            print(f"{'':>4} {dtype:>8} cost: envelope {1 + K} dense runs x {steps} steps "
                  f"+ {K} x {steps} float64{replay} ({envelope_s:.1f} s) vs plain TP=1: "
                  f"1 x {steps}; one TP run {tp_s:.1f} s")
            rows += got
    return rows


def mode_table(title: str, rows: list[dict]) -> None:
    """Per registry mode and dtype: its verdicts over the cases and world sizes, and the
    latest step at which it left the envelope."""
    modes = [LM_EQUIVALENCE] + training_modes()
    print(f"\n{title}: per mode (runs = cases x world sizes); 'left': steps at which "
          f"bugs left the envelope")
    for mode in modes:
        parts = []
        for dtype in DTYPES:
            got = [r for r in rows if r["program"] == mode and r["dtype"] == dtype]
            if not got:
                continue
            kinds = [r["kind"] for r in got]
            left = sorted({r["left"] for r in got if r["left"] is not None})
            through = [r["through"] for r in got if r["kind"] == "inconclusive"]
            text = ", ".join(f"{k} {kinds.count(k)}" for k in ("bug", "rounding", "inconclusive")
                             if kinds.count(k))
            text += f"; left at {left}" if left else ""
            replay_only = sum(r["alone"] != r["verdict"] and r["kind"] == "bug" for r in got)
            text += f" ({replay_only} seen only by the float32 replay)" if replay_only else ""
            text += (f"; rounding through step >= {min(through)}" if through and
                     all(t is not None for t in through) else "")
            if mode == LM_EQUIVALENCE:
                text += f"; max div/env {max(r['max_ratio'] for r in got):.2f}"
            parts.append(f"{dtype} {text}")
        print(f"  {mode:<32} " + " | ".join(parts))


def print_summary(title: str, rows: list[dict]) -> None:
    """One line for correct TP (largest ratio, verdicts), one for the registry's bugs, and the
    detection limit of the scaled g's."""
    right = [r for r in rows if r["program"] == LM_EQUIVALENCE]
    bugs = [r for r in rows if r["program"] in training_modes()]
    kinds = [r["kind"] for r in right]
    caught = [r for r in bugs if r["kind"] == "bug"]
    first = max((r["left"] for r in caught), default=0)
    print(f"{title}: correct TP max div/env {max(r['max_ratio'] for r in right):.2f}; "
          f"rounding {kinds.count('rounding')}, inconclusive {kinds.count('inconclusive')}, "
          f"bug {kinds.count('bug')} of {len(right)}")
    called_rounding = sum(r["kind"] == "rounding" for r in bugs)
    replay_only = sum(r["alone"] != r["verdict"] and r["kind"] == "bug" for r in bugs)
    print(f"{title}: bugs min div/env {min(r['max_ratio'] for r in bugs):.2f}; judged bug "
          f"{len(caught)}/{len(bugs)}, the latest from step {first}; called rounding "
          f"{called_rounding}; seen only by the float32 replay {replay_only}")
    for dtype, deltas in SCALES.items():
        for d in deltas:
            got = [r["verdict"].split(" (")[0] for r in rows
                   if r["program"] == f"g after the MLP x (1 + {d:g})" and r["dtype"] == dtype]
            if got:
                print(f"{title}: {dtype} g after the MLP x (1 + {d:g}): {', '.join(got)}")


def main() -> None:
    """Parses the options, prints the tuned table, then the held-out one, then summaries."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["tune", "held_out"])
    ap.add_argument("--steps-f32", type=int, default=DTYPES["float32"])
    ap.add_argument("--steps-bf16", type=int, default=DTYPES["bfloat16"])
    ap.add_argument("--smoke", action="store_true", help="the first TUNE case, float32, 5 steps")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtypes = {"float32": args.steps_f32, "bfloat16": args.steps_bf16}
    print(f"lr {LR}, K {K} flipped-rounding dense runs, margin {MARGIN}; 'at': step of the "
          f"largest ratio")
    if args.smoke:
        print_summary("smoke", print_rows("SMOKE", TUNE[:1], {"float32": 5}))
        return
    sections = {"tune": ("TUNE (margin and K chosen here)", TUNE),
                "held_out": ("HELD OUT", HELD_OUT)}
    rows = {key: print_rows(title, cases, dtypes) for key, (title, cases) in sections.items()
            if args.only in (None, key)}
    for key, got in rows.items():
        mode_table(key, got)
    print()
    for key, got in rows.items():
        print_summary(key, got)


if __name__ == "__main__":
    main()
