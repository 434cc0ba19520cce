"""Rounding or a bug, at step N: correct TP and three dropped collectives on the decoder LM,
judged against a rounding envelope (``tpattn.model.envelope``), float32 and bfloat16.

Per case (a seed, an LM shape and a dtype) the dense run and ``K`` dense twins one rounding away
(each step's gradient rounding error, against float64, sign-flipped at random) are trained for
``N`` SGD steps on the same random token batches;
the envelope is their largest relative weight distance per step. Then, at world sizes 2 and 4:
correct TP (its largest divergence / envelope ratio and the verdict) and three bugs written here
by substitution, each dropping one collective (``f`` before the MLP, ``g`` after it, ``g``
after the vocabulary-parallel embedding): the step where each leaves margin x envelope. At
W = 2 also ``g`` after the MLP times ``1 + delta`` (``SCALES``): the envelope's detection limit.

The TUNE cases chose ``MARGIN`` and ``K``; the HELD_OUT cases (seeds and shapes
not run while tuning) are reported apart. The cost line compares the envelope's runs x steps
with a plain TP=1 comparison (one dense run); each twin step also takes a float64 gradient.

Measured (2026-12-03, 2 shared cores, one thread, 2.3 min): correct TP's largest
divergence/envelope 1.85 tuned, 1.21 held out (margin 4); every dropped collective >= 15 from
step 1 in bfloat16 (>= 4e5 in float32). bfloat16's own rounding reaches margin x envelope >=
drift at steps 25-41 on three of four cases: "inconclusive" after that. The detection limit
of a systematic error, g x (1 + delta): float32 delta 1e-5 always, 3e-6 in 3 of 4 cases;
bfloat16 delta 0.3 always, 0.1 in 3 of 4.

Usage: python bench/lm_envelope.py [--only tune|held_out] [--steps-f32 N] [--steps-bf16 N]
       python bench/lm_envelope.py --smoke
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from tpattn.config import Config
from tpattn.model.config import LMConfig
from tpattn.model.envelope import (dense_step_fn, divergence, drift, rounding_envelope,
                                   tp_step_fn, train_curve, verdict)
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
#: The cases the margin, K and fraction were chosen on.
TUNE = [
    {"seed": 1, "lm": {}, "block": {}},
    {"seed": 2, "lm": {"vocab": 32, "layers": 2, "ffn": 32},
     "block": {"hidden": 16, "query_heads": 4, "kv_heads": 1, "head_dim": 4, "seq": 8,
               "batch": 2}},
]
LR = 0.1
K = 3
MARGIN = 4.0
DTYPES = {"float32": 100, "bfloat16": 50}


def keep(t, comm, label=None):
    """A dropped collective: ``t`` as it is, forward and backward."""
    return t


#: The bugs, each one collective of LM_CORRECT replaced by ``keep``.
BUGS = {"f missing before the MLP": replace(LM_CORRECT, mlp_f=keep, name="no_mlp_f"),
        "g missing after the MLP": replace(LM_CORRECT, mlp_g=keep, name="no_mlp_g"),
        "g missing after the embedding": replace(LM_CORRECT, embed_g=keep, name="no_embed_g")}


#: The detection limit: g after the MLP times (1 + delta), at W = 2, per dtype.
SCALES = {"float32": (1e-6, 3e-6, 1e-5), "bfloat16": (0.03, 0.1, 0.3)}


def scaled_g(delta: float):
    """g after the MLP, its sum times ``1 + delta``: a small systematic error."""
    def g(t, comm, label=None):
        return ReduceFromRanks.apply(t, comm, label) * (1 + delta)
    return g


def programs(world_size: int, dtype: str) -> dict:
    """Correct TP, the bugs, and at world size 2 the scaled g's of ``SCALES``."""
    scaled = {f"g after the MLP x (1 + {d:g})": replace(LM_CORRECT, mlp_g=scaled_g(d))
              for d in SCALES[dtype]} if world_size == 2 else {}
    return {"correct": LM_CORRECT, **BUGS, **scaled}


def make_lm(case: dict, world_size: int, dtype: str) -> LMConfig:
    """The case's LM at ``world_size`` in ``dtype``."""
    return LMConfig(block=Config(world_size=world_size, dtype=dtype, **case["block"]),
                    **case["lm"])


def make_batches(lm: LMConfig, seed: int, steps: int) -> list[torch.Tensor]:
    """``steps`` random token batches ``[S, B]`` (own generator from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lm.vocab, (lm.block.seq, lm.block.batch), generator=g)
            for _ in range(steps)]


def run_case(case: dict, dtype: str, steps: int) -> list[dict]:
    """One case: the envelope once (the dense LM does not depend on the world size), then
    correct TP and every bug at world sizes 2 and 4; one row per judged run."""
    lm = make_lm(case, 2, dtype)
    params, batches = init_lm_params(lm, case["seed"]), make_batches(lm, case["seed"], steps)
    t0 = time.perf_counter()
    dense = train_curve(dense_step_fn(lm), params, batches, LR)
    envelope = rounding_envelope(dense_step_fn(lm), dense_step_fn(lm, "float64"), params,
                                 batches, LR, dense, K, seed=case["seed"])
    envelope_s = time.perf_counter() - t0
    rows = []
    for w in (2, 4):
        lm_w = make_lm(case, w, dtype)
        for name, prog in programs(w, dtype).items():
            t1 = time.perf_counter()
            run = train_curve(tp_step_fn(lm_w, prog), params, batches, LR)
            ratio = divergence(run, dense)["weights"] / envelope
            rows.append({"world_size": w, "program": name, "steps": steps, "dtype": dtype,
                         "max_ratio": float(ratio.max()), "at": int(ratio.argmax()) + 1,
                         "verdict": verdict(dense, run, envelope, MARGIN),
                         "tp_s": time.perf_counter() - t1, "envelope_s": envelope_s,
                         "saturation": saturation_step(dense, envelope)})
    return rows


def saturation_step(dense: dict, envelope: torch.Tensor) -> int | None:
    """The first step (from 1) where MARGIN x envelope reaches the dense run's drift."""
    hit = (MARGIN * envelope >= drift(dense)).nonzero()
    return int(hit[0]) + 1 if len(hit) else None


def print_rows(title: str, cases: list[dict], dtypes: dict) -> list[dict]:
    """Runs every case in every dtype, prints one line per judged run; returns the rows."""
    print(f"\n## {title}")
    print(f"{'case':>4} {'dtype':>8} {'W':>2} {'program':<32} {'max div/env':>11} "
          f"{'at':>4} {'sat':>4}  verdict")
    rows = []
    for case in cases:
        for dtype, steps in dtypes.items():
            for r in run_case(case, dtype, steps):
                rows.append(r)
                print(f"{case['seed']:>4} {dtype:>8} {r['world_size']:>2} {r['program']:<32} "
                      f"{r['max_ratio']:>11.3g} {r['at']:>4} {str(r['saturation']):>4}  "
                      f"{r['verdict'][:44]}")
            print(f"{'':>4} {dtype:>8} cost: envelope {1 + K} dense runs x {steps} steps "
                  f"+ {K} x {steps} float64 ({r['envelope_s']:.1f} s) vs plain TP=1: "
                  f"1 x {steps}; one TP run {r['tp_s']:.1f} s")
    return rows


def print_summary(title: str, rows: list[dict]) -> None:
    """One line for correct TP (largest ratio, verdicts) and one for the bugs."""
    right = [r for r in rows if r["program"] == "correct"]
    bugs = [r for r in rows if r["program"] in BUGS]
    kinds = [r["verdict"].split(" ")[0] for r in right]
    caught = [r for r in bugs if r["verdict"].startswith("bug")]
    first = max((int(r["verdict"].split()[-1]) for r in caught), default=0)
    print(f"{title}: correct TP max div/env {max(r['max_ratio'] for r in right):.2f}; "
          f"rounding {kinds.count('rounding')}, inconclusive {kinds.count('inconclusive')}, "
          f"bug {kinds.count('bug')} of {len(right)}")
    print(f"{title}: bugs min div/env {min(r['max_ratio'] for r in bugs):.2f}; judged bug "
          f"{len(caught)}/{len(bugs)}, the latest from step {first}")
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
          f"largest ratio; 'sat': first step where margin x envelope >= the dense run's drift")
    if args.smoke:
        print_summary("smoke", print_rows("SMOKE", TUNE[:1], {"float32": 5}))
        return
    sections = {"tune": ("TUNE (margin and K chosen here)", TUNE),
                "held_out": ("HELD OUT", HELD_OUT)}
    rows = {key: print_rows(title, cases, dtypes) for key, (title, cases) in sections.items()
            if args.only in (None, key)}
    print()
    for key, got in rows.items():
        print_summary(key, got)


if __name__ == "__main__":
    main()
