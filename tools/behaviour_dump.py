"""Dump what the package does, as JSON, so a refactor can prove nothing changed.

    python tools/behaviour_dump.py OUT.json [--quick]

Run it from the repository root with ``PYTHONPATH=$PWD`` (so ``import tpattn`` loads this
tree). ``tools/behaviour_compare.py BEFORE.json AFTER.json`` then compares two dumps.

What is dumped (one entry per case, keyed so that two dumps line up):

- ``run``: ``tpattn.run(seed, mode, cfg, simulate)`` for every mode of ``--list-modes`` x
  the seeds x ``SHAPES`` (every literal ``Config`` the tests and the package check at
  b42a997, but the Llama-size ones) x both simulations; a ``ValueError`` (or any other
  exception) is recorded as its type and message.
- ``run_auto``: ``tolerance="auto"`` for the modes ``run`` accepts it for (fewer seeds):
  the bounds, the verdicts.
- ``run_error``: ``run``'s messages for bad seeds, modes, simulations, tolerances, inits.
- ``config``: ``repr(Config(**kw))`` or the ``ValueError`` for the test's invalid shapes.
- ``cli``: stdout, stderr and exit code of every example command in README.md and
  book/appendix/cli.ipynb (in-process through ``tpattn.cli.main``; the ``torchrun``
  example as a subprocess, its stderr not compared: it carries timestamps and pids).
- ``observe`` / ``diagnose`` / ``describe``: hunts 0..59 (``bug_hunt.hunt_case``) and
  every mode on the hunt shapes at two seeds; ``diagnose`` of five-measure results.
- ``exercise``: every checker on the book's solution, its stub and the known-wrong answers
  of tests/frontends/test_exercises.py and tests/wrong_answers_later.py.

Each entry says how its floats may be compared: ``floats: "bits"`` (bit-identical: the
seed fixture's path, the default CLI) or ``"bound"`` with ``rtol`` (the package's relative
rounding bound ``rho`` of the entry's Config, ``tolerance.relative_bound``) and ``atol`` by
key (the auto bound of each measure at that Config and seed, ``run(...,
tolerance="auto")["bounds"]``; ``"*"``: ``rho`` for any other float). Everything that is not
a float (verdicts, pass flags, ledgers, diagnoses, messages) is compared exactly.

Names are looked up through the top-level API (``tpattn.run``, ``tpattn.observe``,
``tpattn.diagnose``, ``tpattn.cli.main``) and, for the rest, a table of candidate module
paths (``CANDIDATES``) with a search of the package as a last resort, so the tool keeps
working after the modules move into subpackages.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import json
import math
import os
import pkgutil
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMAT = "tpattn-behaviour-dump/1"

#: Seeds of every run; the shapes marked large get ``LARGE_SEEDS`` (a subsample, said in
#: the header).
SEEDS = tuple(range(1, 13))
LARGE_SEEDS = (1, 2, 3, 4)
AUTO_SEEDS = (1, 2, 3)
SIMULATIONS = ("fixture", "ranks")
#: The seed fixture's three modes: at the default Config in the fixture's simulation they
#: must stay bit for bit.
SEED_MODES = ("equivalence", "missing_output_reduce", "missing_input_grad_reduce")

#: Every literal Config of tests/, tpattn/ and bench/ at b42a997 (found with ast), but the
#: Llama-size ones (hidden 4096/8192), plus the world sizes and strategies the tests
#: parametrize. (kwargs, large): large shapes run on LARGE_SEEDS.
SHAPES = (
    ({}, False),
    ({"world_size": 1}, False),
    ({"seq": 8}, False),
    ({"dtype": "float64"}, False),
    ({"dtype": "bfloat16"}, False),
    ({"query_heads": 8, "kv_heads": 4}, False),
    ({"query_heads": 8, "kv_heads": 4, "world_size": 4}, False),
    ({"query_heads": 16, "kv_heads": 8, "world_size": 4}, False),
    ({"seq": 4, "query_heads": 16, "kv_heads": 8, "world_size": 4}, False),
    ({"query_heads": 6, "kv_heads": 3, "world_size": 3}, False),
    ({"query_heads": 8, "kv_heads": 2, "world_size": 4}, False),
    ({"query_heads": 8, "kv_heads": 2, "world_size": 4, "kv_strategy": "gather_activations"},
     False),
    ({"query_heads": 8, "kv_heads": 1, "world_size": 4}, False),
    ({"query_heads": 8, "kv_heads": 1, "world_size": 4, "kv_strategy": "gather_activations"},
     False),
    ({"query_heads": 4, "kv_heads": 1, "world_size": 4}, False),
    ({"query_heads": 4, "kv_heads": 1, "world_size": 2}, False),
    ({"query_heads": 16, "kv_heads": 2, "world_size": 8}, False),
    ({"query_heads": 16, "kv_heads": 2, "head_dim": 8, "world_size": 8}, False),
    ({"query_heads": 8, "kv_heads": 4, "world_size": 4, "dtype": "bfloat16"}, False),
    ({"query_heads": 8, "kv_heads": 2, "world_size": 4, "dtype": "bfloat16"}, False),
    ({"seq": 3, "query_heads": 8, "kv_heads": 4, "world_size": 4, "dtype": "float64"}, False),
    ({"seq": 7, "batch": 3, "hidden": 32, "query_heads": 8, "kv_heads": 2, "world_size": 4},
     False),
    ({"seq": 7, "batch": 3, "hidden": 32, "query_heads": 8, "kv_heads": 2, "head_dim": 4,
      "world_size": 2}, False),
    ({"seq": 7, "batch": 3, "hidden": 12, "query_heads": 6, "kv_heads": 2, "head_dim": 2,
      "world_size": 2}, False),
    ({"seq": 6, "batch": 2, "hidden": 20, "query_heads": 16, "kv_heads": 8, "head_dim": 4,
      "world_size": 8, "dtype": "float64"}, False),
    ({"seq": 3, "batch": 1, "hidden": 8, "query_heads": 8, "kv_heads": 2, "head_dim": 2,
      "world_size": 8}, False),
    ({"seq": 3, "batch": 1, "hidden": 8, "query_heads": 6, "kv_heads": 2, "head_dim": 2},
     False),
    ({"seq": 4, "batch": 1, "hidden": 8, "query_heads": 8, "kv_heads": 4, "head_dim": 4,
      "world_size": 4}, False),
    ({"seq": 3, "batch": 2, "hidden": 16, "query_heads": 4, "kv_heads": 4, "head_dim": 6,
      "world_size": 1}, False),
    ({"seq": 6, "hidden": 12, "query_heads": 6, "kv_heads": 3, "head_dim": 4, "world_size": 1,
      "dtype": "float64"}, False),
    ({"seq": 1, "batch": 1, "hidden": 1, "query_heads": 2, "kv_heads": 2, "head_dim": 2,
      "dtype": "bfloat16"}, False),
    ({"seq": 4, "sequence_parallel": True}, False),
    ({"seq": 8, "sequence_parallel": True}, False),
    ({"seq": 8, "sequence_parallel": True, "dtype": "bfloat16"}, False),
    ({"seq": 8, "query_heads": 8, "kv_heads": 4, "world_size": 4, "sequence_parallel": True},
     False),
    ({"seq": 8, "query_heads": 4, "kv_heads": 4, "world_size": 4, "sequence_parallel": True},
     False),
    ({"seq": 12, "query_heads": 4, "kv_heads": 4, "world_size": 4, "sequence_parallel": True},
     False),
    ({"seq": 6, "batch": 1, "hidden": 8, "query_heads": 6, "kv_heads": 3, "head_dim": 2,
      "world_size": 3, "sequence_parallel": True}, False),
    # tests/parallel/test_sequence_parallel.py's realistic float64 SP, world sizes 1, 2, 4
    *(({"seq": 16, "batch": 2, "hidden": 256, "query_heads": 8, "kv_heads": 4, "head_dim": 32,
        "world_size": w, "dtype": "float64", "sequence_parallel": True}, True)
      for w in (1, 2, 4)),
    # book/appendix/cli.ipynb's larger block (float32 rounding above 1e-6)
    ({"seq": 16, "hidden": 256, "query_heads": 24, "kv_heads": 8, "head_dim": 6,
      "world_size": 8}, True),
)

#: Invalid shapes the tests construct: their messages must stay.
BAD_SHAPES = (
    {"query_heads": 8, "kv_heads": 1, "world_size": 3},
    {"query_heads": 6, "kv_heads": 3, "world_size": 2},
    {"seq": 4, "sequence_parallel": "yes"},
    {"sequence_parallel": True},
    {"kv_heads": 3},
    {"kv_heads": 2, "query_heads": 6, "world_size": 3, "kv_strategy": "gather_activations"},
    {"kv_strategy": "gather"},
    {"kv_heads": 1, "query_heads": 8, "world_size": 8, "kv_strategy": "gather_activations"},
    {"seq": 0},
    {"head_dim": 3},
    {"eps": 0.0},
    {"dtype": "float16"},
    {"seq": 6, "query_heads": 8, "kv_heads": 2, "world_size": 4, "sequence_parallel": True},
)

#: Where each non-top-level name lived at b42a997, then where it may move (first match wins;
#: after these, every tpattn module is searched).
CANDIDATES = {
    "relative_bound": ["tpattn.check.tolerance", "tpattn.check.core.tolerance", "tpattn.checks.tolerance",
                       "tpattn.check.core.tolerances", "tpattn.tolerances"],
    "hunt_case": ["tpattn.diagnosis.hunt", "tpattn.bugs.bug_hunt", "tpattn.diagnosis.hunt",
                  "tpattn.diagnosis.bug_hunt", "tpattn.bugs"],
    "describe": ["tpattn.diagnosis.hunt", "tpattn.bugs.bug_hunt", "tpattn.diagnosis.hunt",
                 "tpattn.diagnosis.bug_hunt", "tpattn.bugs"],
    "exercises": ["tpattn.exercises", "tpattn.exercises.checkers", "tpattn.exercises.check"],
    "Config": ["tpattn", "tpattn.config", "tpattn.block.config"],
    "build_parser": ["tpattn.cli"],
    "config_from_args": ["tpattn.cli"],
}
#: Keys under which a float is a bound, not a measure: compared with rtol and atol["*"].
REL_UNDER = ("bounds", "floors", "amplification")
#: Modules the last-resort search does not import (heavy or optional dependencies).
SKIP_SEARCH = ("viz", "widgets", "interop", "module_check", "dtensor", "typecheck", "lab")

#: README's and the CLI appendix's example commands (the CLI appendix's loops unrolled).
README_COMMANDS = None  # read from README.md at dump time (every ```bash line with tpattn)
NOTEBOOK_COMMANDS = [
    "tpattn --help",
    "python -m tpattn --mode equivalence --seed 11",
    "tpattn --mode missing_input_grad_reduce --seed 11",
    "tpattn --mode matrix --seeds 11 17",
    *(f"tpattn --seq 16 --hidden 256 --query-heads 24 --kv-heads 8 --head-dim 6 "
      f"--world-size 8 --strict --seed {s} --dtype {d}"
      for d in ("float32", "float64") for s in (1, 2, 3, 4)),
    "tpattn --kv-heads 3",
    "tpattn --list-modes",
    "tpattn --mode input_grad_reduced_twice --diagnose",
]


def resolve(name: str):
    """The object ``name`` (a function or module's short name) at its first candidate path,
    else the one tpattn module that defines it."""
    for path in CANDIDATES.get(name, []):
        try:
            module = importlib.import_module(path)
        except ImportError:
            continue
        if path.rsplit(".", 1)[-1] == name:
            return module
        if hasattr(module, name):
            return getattr(module, name)
    import tpattn

    for info in pkgutil.walk_packages(tpattn.__path__, "tpattn."):
        if any(part in info.name for part in SKIP_SEARCH):
            continue
        if info.name.rsplit(".", 1)[-1] == name:
            return importlib.import_module(info.name)
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue
        value = getattr(module, name, None)
        if value is not None and getattr(value, "__module__", "") == info.name:
            return value
    raise LookupError(f"cannot find {name} in tpattn (candidates: {CANDIDATES.get(name)})")


def shape_key(kw: dict) -> str:
    return json.dumps(kw, sort_keys=True)


def error_of(e: BaseException) -> dict:
    return {"error": type(e).__name__, "message": str(e)}


def jsonable(value):
    """``value`` with tuples as lists, non-string keys as strings, and anything else JSON
    cannot hold as its repr (floats stay floats: json writes repr, which round-trips)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        import torch

        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
    except ImportError:
        pass
    return repr(value)


#: Environment variables that pick CPU kernels: torch.randn's vectorized path draws other
#: float32 inputs under ATEN_CPU_CAPABILITY=default, so dumps compare only under one setting.
KERNEL_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "OMP_NUM_THREADS")


def kernel_env() -> dict:
    """The CPU, torch's kernel capability and ``KERNEL_VARS``: what must match between two
    dumps for their floats to be comparable (``behaviour_compare`` warns otherwise)."""
    import torch

    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **{name: os.environ.get(name) for name in KERNEL_VARS}}


class Dumper:
    def __init__(self, quick: bool = False):
        import tpattn

        self.tpattn = tpattn
        self.Config = tpattn.Config
        self.quick = quick
        self.entries: dict[str, dict] = {}
        self.relative_bound = resolve("relative_bound")
        self._bounds: dict = {}
        self.timings: dict[str, float] = {}

    # --- entries ------------------------------------------------------------------------
    def add(self, key: str, kind: str, value, floats: str = "bound", rtol: float = 0.0,
            atol: dict | None = None) -> None:
        assert key not in self.entries, key
        entry = {"kind": kind, "floats": floats, "value": jsonable(value)}
        if floats == "bound":
            entry["rtol"] = rtol
            entry["atol"] = atol or {"*": rtol}
            # a bound or floor is itself rho * scale: relative only, not a measure's atol
            entry["rel_under"] = list(REL_UNDER)
        self.entries[key] = entry

    def rho(self, cfg) -> float:
        return float(self.relative_bound(cfg))

    def bounds(self, kw: dict, seed: int) -> dict:
        """The auto bound per measure at this shape and seed, ``"*"``: rho."""
        key = (shape_key(kw), seed)
        if key not in self._bounds:
            cfg = self.Config(**kw)
            rho = self.rho(cfg)
            try:
                b = self.tpattn.run(seed, "equivalence", cfg, "fixture", tolerance="auto")
                atol = {m: float(v) for m, v in b["bounds"].items()}
            except Exception:  # a shape "auto" does not cover: the relative bound only
                atol = {}
            atol["*"] = rho
            self._bounds[key] = atol
        return self._bounds[key]

    # --- sections -----------------------------------------------------------------------
    def modes(self) -> list[str]:
        code, out, err = self.cli(["--list-modes"])
        return [m["name"] for m in json.loads(out)]

    def runs(self, modes: list[str]) -> None:
        shapes = SHAPES[:3] if self.quick else SHAPES
        for kw, large in shapes:
            cfg = self.Config(**kw)
            seeds = LARGE_SEEDS if large else SEEDS
            if self.quick:
                seeds = seeds[:2]
            rho = self.rho(cfg)
            for seed in seeds:
                atol = self.bounds(kw, seed)
                for mode in modes:
                    for sim in SIMULATIONS:
                        try:
                            value = self.tpattn.run(seed, mode, cfg, sim)
                        except Exception as e:  # noqa: BLE001 - the message is the behaviour
                            value = error_of(e)
                        bits = kw == {} and mode in SEED_MODES and sim == "fixture"
                        self.add(f"run|{shape_key(kw)}|{mode}|seed={seed}|{sim}", "run", value,
                                 "bits" if bits else "bound", rho, atol)

    def runs_auto(self, modes: list[str]) -> None:
        shapes = SHAPES[:3] if self.quick else SHAPES
        for kw, large in shapes:
            if large:
                continue
            cfg = self.Config(**kw)
            rho = self.rho(cfg)
            for seed in AUTO_SEEDS[:1] if self.quick else AUTO_SEEDS:
                atol = self.bounds(kw, seed)
                for mode in modes:
                    for sim in SIMULATIONS:
                        for init in ("seed", "fan_in"):
                            try:
                                value = self.tpattn.run(seed, mode, cfg, sim, tolerance="auto",
                                                        init=init)
                            except Exception as e:  # noqa: BLE001
                                value = error_of(e)
                            self.add(f"run_auto|{shape_key(kw)}|{mode}|seed={seed}|{sim}|"
                                     f"init={init}", "run_auto", value, "bound", rho, atol)

    def run_errors(self) -> None:
        run, Config = self.tpattn.run, self.Config
        cases = {
            "seed=-1": lambda: run(-1),
            "seed=True": lambda: run(True),
            "seed=2**63": lambda: run(2**63),
            "seed=1.5": lambda: run(1.5),
            "mode=nope": lambda: run(11, "nope"),
            "mode=None": lambda: run(11, None),
            "mode=missing_norm_grad_reduce": lambda: run(11, "missing_norm_grad_reduce"),
            "mode=missing_kv_grad_reduce": lambda: run(11, "missing_kv_grad_reduce"),
            "simulate=real": lambda: run(11, "equivalence", None, "real"),
            "tolerance=loose": lambda: run(11, "equivalence", tolerance="loose"),
            "init=xavier": lambda: run(11, "equivalence", init="xavier"),
            "zoo+auto": lambda: run(11, "output_reduced_twice", tolerance="auto"),
            "zoo+fan_in": lambda: run(11, "output_reduced_twice", init="fan_in"),
            "zoo+simulate=real": lambda: run(11, "output_reduced_twice", None, "real"),
            "zoo+seed=-1": lambda: run(-1, "output_reduced_twice"),
            "run_matrix+mode=nope": lambda: self.tpattn.run_matrix([11], ["nope"]),
            "run_matrix+seed=-1": lambda: self.tpattn.run_matrix([-1]),
            "observe+mode=nope": lambda: self.tpattn.observe("nope"),
            "observe+steps=0": lambda: self.tpattn.observe("equivalence", 11, None, 0),
            "observe+ws1": lambda: self.tpattn.observe("missing_output_reduce", 11,
                                                       Config(world_size=1)),
            "diagnose+list": lambda: self.tpattn.diagnose([]),
            "diagnose+dict": lambda: self.tpattn.diagnose({"setup": {}}),
        }
        for name, call in cases.items():
            try:
                value = {"returned": call()}
            except Exception as e:  # noqa: BLE001
                value = error_of(e)
            self.add(f"run_error|{name}", "run_error", value, "bits")

    def configs(self) -> None:
        for kw in [k for k, _ in SHAPES] + list(BAD_SHAPES):
            try:
                value = {"repr": repr(self.Config(**kw))}
            except Exception as e:  # noqa: BLE001
                value = error_of(e)
            self.add(f"config|{shape_key(kw)}", "config", value, "bits")

    # --- CLI ----------------------------------------------------------------------------
    def cli(self, argv: list[str], prog: str = "tpattn") -> tuple[int, str, str]:
        """``tpattn.cli.main(argv, prog)`` in this process: (exit code, stdout, stderr)."""
        from tpattn.cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv, prog=prog)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return code, out.getvalue(), err.getvalue()

    def cli_bounds(self, argv: list[str], stdout: str) -> tuple[float, dict]:
        """rho of the command's Config and the largest auto bound per measure over the
        seeds its output reports."""
        build_parser, config_from_args = resolve("build_parser"), resolve("config_from_args")
        try:
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                cfg = config_from_args(build_parser().parse_args(argv))
        except (SystemExit, ValueError):
            cfg = self.Config()
        kw = {k: v for k, v in cfg.as_dict().items()
              if v != getattr(self.Config, k, None)} if hasattr(cfg, "as_dict") else {}
        rho = self.rho(cfg)
        atol = {"*": rho}
        try:
            out = json.loads(stdout)
        except ValueError:
            return rho, atol
        results = out if isinstance(out, list) else [out]
        for r in results:
            if isinstance(r, dict) and isinstance(r.get("seed"), int):
                shown = r.get("bounds") if isinstance(r.get("bounds"), dict) else {}
                for m, b in [*self.bounds(kw, r["seed"]).items(), *shown.items()]:
                    atol[m] = max(atol.get(m, 0.0), b)  # the output's own (init=fan_in)
        return rho, atol

    def commands(self) -> list[str]:
        text = (ROOT / "README.md").read_text()
        found = []
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                if re.match(r"^(python -m tpattn|tpattn|torchrun)\b", line):
                    found.append(line)
        return found + [c for c in NOTEBOOK_COMMANDS if c not in found]

    def clis(self) -> None:
        for command in self.commands():
            words = shlex.split(command)
            if words[0] == "torchrun":
                self.torchrun(command, words)
                continue
            prog = "python -m tpattn" if words[0] == "python" else "tpattn"
            argv = words[3:] if words[0] == "python" else words[1:]
            code, out, err = self.cli(argv, prog)
            value = {"argv": argv, "exit": code, "stdout": out, "stderr": err}
            seed_path = all(a in ("--mode", "--seed", "--seeds", "--strict", *SEED_MODES,
                                  "matrix") or a.isdigit() for a in argv)
            rho, atol = self.cli_bounds(argv, out)
            self.add(f"cli|{command}", "cli", value, "bits" if seed_path else "bound", rho, atol)

    def torchrun(self, command: str, words: list[str]) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        argv = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
        t0 = time.time()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
            value = {"argv": words[1:], "exit": proc.returncode, "stdout": proc.stdout,
                     "stderr": None}  # timestamps and pids: not compared
        except subprocess.TimeoutExpired:
            value = {"argv": words[1:], "exit": "timeout", "stdout": None, "stderr": None}
        self.timings[f"torchrun {' '.join(words[1:])}"] = round(time.time() - t0, 1)
        rho, atol = self.cli_bounds(words[6:], value["stdout"] or "")
        self.add(f"cli|{command}", "cli", value, "bound", rho, atol)

    # --- observe, diagnose, hunts -------------------------------------------------------
    def observations(self, modes: list[str]) -> None:
        hunt_case, describe = resolve("hunt_case"), resolve("describe")
        for n in range(6 if self.quick else 60):
            mode, seed, cfg = hunt_case(n)
            self.observe_case(f"hunt={n}", mode, seed, cfg, describe,
                              {"mode": mode, "seed": seed, "cfg": repr(cfg)})
        shapes = [{}, {"query_heads": 8, "kv_heads": 4},
                  {"seq": 4, "query_heads": 16, "kv_heads": 8, "world_size": 4},
                  {"query_heads": 8, "kv_heads": 2, "world_size": 4},
                  {"seq": 8, "sequence_parallel": True}]
        for kw in shapes[:1] if self.quick else shapes:
            for mode in modes:
                for seed in (11, 5):
                    self.observe_case(f"{shape_key(kw)}|{mode}|seed={seed}", mode, seed,
                                      self.Config(**kw), describe, None)
        # diagnose of five-measure results (the path chapter 10 and --diagnose's list use)
        cfg = self.Config()
        for mode in modes:
            for seed in (11, 5):
                try:
                    value = self.tpattn.diagnose(self.tpattn.run(seed, mode, cfg), cfg)
                except Exception as e:  # noqa: BLE001
                    value = error_of(e)
                self.add(f"diagnose_run|{mode}|seed={seed}", "diagnose", value, "bits")

    def observe_case(self, key: str, mode, seed, cfg, describe, case) -> None:
        rho = self.rho(cfg)
        try:
            obs = self.tpattn.observe(mode, seed, cfg)
        except Exception as e:  # noqa: BLE001
            self.add(f"observe|{key}", "observe", {"case": case, **error_of(e)}, "bound", rho)
            return
        self.add(f"observe|{key}", "observe", {"case": case, "obs": obs}, "bound", rho)
        for name, call in (("diagnose", lambda: self.tpattn.diagnose(obs)),
                           ("describe", lambda: describe(obs))):
            try:
                value = call()
            except Exception as e:  # noqa: BLE001
                value = error_of(e)
            self.add(f"{name}|{key}", name, value, "bits")

    # --- exercises ----------------------------------------------------------------------
    def test_module(self, name: str):
        """A module of tests/ found by file name (the tests may be regrouped in folders)."""
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        paths = sorted((ROOT / "tests").rglob(f"{name}.py"))
        if not paths:
            raise LookupError(f"no tests/**/{name}.py")
        dotted = ".".join(paths[0].relative_to(ROOT).with_suffix("").parts)
        return importlib.import_module(dotted)

    def exercises(self) -> None:
        ex = resolve("exercises")
        te = self.test_module("test_exercises")
        for nb, check, name, stub, code in te.EXERCISES:
            for which, source in (("solution", code), ("stub", stub)):
                try:
                    result = getattr(ex, check)(te.load(source, name, f"<{nb}>"))
                    value = {"name": getattr(result, "name", None), "passed": result.passed,
                             "message": result.message}
                except Exception as e:  # noqa: BLE001
                    value = error_of(e)
                self.add(f"exercise|{check}|{which}", "exercise", value, "bits")
        wrong = getattr(te, "ALL_WRONG", None) or te.WRONG
        for i, (check, answer, expected) in enumerate(wrong):
            try:
                result = getattr(ex, check)(answer)
                value = {"name": getattr(result, "name", None), "passed": result.passed,
                         "message": result.message, "expected_part": expected}
            except Exception as e:  # noqa: BLE001
                value = error_of(e)
            self.add(f"exercise|{check}|wrong={i}", "exercise", value, "bits")

    # --- all ----------------------------------------------------------------------------
    def dump(self) -> dict:
        import torch

        t_all = time.time()
        modes = self.modes()
        sections = [("cli", self.clis), ("configs", self.configs),
                    ("run_errors", self.run_errors), ("runs", lambda: self.runs(modes)),
                    ("runs_auto", lambda: self.runs_auto(modes)),
                    ("observe", lambda: self.observations(modes)),
                    ("exercises", self.exercises)]
        for name, section in sections:
            t0 = time.time()
            section()
            self.timings[name] = round(time.time() - t0, 1)
        kinds: dict[str, int] = {}
        for e in self.entries.values():
            kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
        self.timings["total"] = round(time.time() - t_all, 1)
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = None
        import tpattn

        digest = hashlib.sha256()
        for path in sorted(Path(tpattn.__file__).parent.rglob("*.py")):
            digest.update(path.relative_to(ROOT).as_posix().encode() + path.read_bytes())
        header = {
            "commit": commit,
            "tpattn_dir": str(Path(tpattn.__file__).parent),
            "tpattn_sha256": digest.hexdigest(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "env": kernel_env(),
            "quick": self.quick,
            "modes": modes,
            "seeds": list(SEEDS), "large_shape_seeds": list(LARGE_SEEDS),
            "auto_seeds": list(AUTO_SEEDS),
            "subsampled": ("shapes marked large (hidden 256) run seeds 1-4 only; "
                           "tolerance='auto' runs seeds 1-3 on the other shapes; the "
                           "Llama-size shapes of the tests (hidden 4096/8192) are left out"),
            "shapes": [{"config": kw, "large": large} for kw, large in SHAPES],
            "criterion": ("floats 'bits': identical repr; 'bound': |a-b| <= atol[key] + "
                          "rtol*max(|a|,|b|), rtol = tolerance.relative_bound(cfg), atol = the "
                          "auto bound of the measure named by the key, else rtol; everything "
                          "else exact"),
            "entries_by_kind": kinds,
            "seconds": self.timings,
        }
        return {"format": FORMAT, "header": header, "entries": self.entries}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="where to write the JSON dump")
    ap.add_argument("--quick", action="store_true",
                    help="a few shapes, seeds and hunts only (a smoke test of the tool)")
    args = ap.parse_args(argv)
    os.environ.setdefault("COLUMNS", "80")  # argparse's --help wraps at the terminal width
    import torch

    torch.set_num_threads(1)  # tiny matmuls: threads only contend; same results either way
    dump = Dumper(args.quick).dump()
    Path(args.out).write_text(json.dumps(dump, indent=1, sort_keys=False) + "\n")
    h = dump["header"]
    print(f"wrote {args.out}: {len(dump['entries'])} entries {h['entries_by_kind']} "
          f"in {h['seconds']['total']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
