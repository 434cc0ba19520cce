"""``python -m tpattn``: the original fixture's command line and JSON, plus Config flags, and
``--model lm`` (``tpattn.cli_lm``). Exit 0 when the run completed, 1 with ``--strict`` when an
``equivalence`` (``lm_equivalence``) run failed, 2 for bad arguments (one line on stderr)."""
from __future__ import annotations

import argparse
from dataclasses import fields
import json
import re
import sys

from tpattn.bugs.lm_zoo import LM_EQUIVALENCE
from tpattn.bugs.modes import modes_for, run, run_matrix
from tpattn.check.core import ALL_MODES, EQUIVALENCE, SEEDS, SIMULATIONS, inspect_fixture
from tpattn.config import DTYPES, KV_STRATEGIES, Config
from tpattn.block.params import INITS
from tpattn.check.tolerance import TOLERANCES
from tpattn.cli_lm import add_lm_flags, check_block_args, lm_listing, lm_main

CLI_MODES = ("inspect",) + ALL_MODES + ("matrix",)
_CONFIG_FLAGS = ("seq", "batch", "hidden", "query_heads", "kv_heads", "head_dim", "world_size")


def cli_modes() -> tuple[str, ...]:
    """``--mode``'s choices: ``CLI_MODES``, then the bug registry's others in listing order,
    then the LM's modes (``--model lm``)."""
    from tpattn.bugs.lm_zoo import lm_mode_names
    from tpattn.bugs.zoo import mode_names

    return tuple(dict.fromkeys(CLI_MODES + tuple(mode_names()) + tuple(lm_mode_names())))


def unknown_mode_message(mode: str) -> str:
    """The one-line error for an unknown ``--mode``: at most three nearest modes."""
    import difflib

    modes = cli_modes()
    word = mode.split("_")[0] + "_"  # "missing_f": every missing_* mode is a candidate
    near = ([m for m in modes if len(mode) >= 3 and m.startswith(mode)]
            + difflib.get_close_matches(mode, modes, n=4, cutoff=0.5)
            + [m for m in modes if "_" in mode and m.startswith(word)])
    near = list(dict.fromkeys(near))[:3]
    hint = f"nearest: {', '.join(near)}; " if near else ""
    return f"argument --mode: invalid choice: {mode!r} ({hint}all of them: --list-modes)"


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose usage error is one line and exit 2 (an unknown ``--mode``: the nearest)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        bad = re.match(r"argument --mode: invalid choice: '(.*?)' \(choose from", message)
        if bad:
            message = unknown_mode_message(bad.group(1))
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_config_flags(ap: argparse.ArgumentParser, defaults: Config) -> None:
    """The flags that set ``Config`` fields (``config_from_args`` reads them back)."""
    for name in _CONFIG_FLAGS:
        aliases = ("--tp",) if name == "world_size" else ()  # the TP degree of a TP x DP mesh
        ap.add_argument("--" + name.replace("_", "-"), *aliases, type=int,
                        default=getattr(defaults, name), metavar="N",
                        help=f"Config.{name} (default: %(default)s)")
    ap.add_argument("--dp", type=int, default=defaults.data_parallel, metavar="N",
                    dest="data_parallel",
                    help="Config.data_parallel: the DP degree of a TP x DP mesh of "
                         "tp * dp ranks (default: %(default)s)")
    ap.add_argument("--eps", type=float, default=defaults.eps, help="Config.eps (default: %(default)s)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=defaults.dtype,
                    help="Config.dtype (default: %(default)s)")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="shard the residual stream along the sequence (Config.sequence_parallel; "
                         "needs seq %% world-size == 0); --mode matrix then runs every SP mode")
    ap.add_argument("--kv-strategy", choices=KV_STRATEGIES, default=defaults.kv_strategy,
                    help="Config.kv_strategy, when kv_heads < world_size (default: %(default)s)")
    ap.add_argument("--dropout", type=float, default=defaults.dropout, metavar="P",
                    help="Config.dropout: attention and residual dropout probability in "
                         "[0, 1), drawn as Megatron's RNG tracker does (default: %(default)s)")
    ap.add_argument("--qk-norm", action="store_true",
                    help="Config.qk_norm: RMSNorm on every query and key head before RoPE, "
                         "weights replicated on every TP rank")


def build_parser(prog: str = "tpattn", simulated: bool = True) -> argparse.ArgumentParser:
    """The argument parser; ``simulated=False`` (real ranks) leaves out the simulation flags."""
    defaults = Config()
    ap = _OneLineParser(prog=prog, description=(
        "Compare a dense attention block with its tensor-parallel version on five measures "
        "(forward, loss, input grad, parameter grads, weights after one SGD step)."))
    ap.add_argument("--mode", choices=cli_modes(), default=EQUIVALENCE, metavar="MODE",
                    help="what to run: inspect, matrix, or a mode of --list-modes; with "
                         "--model lm: matrix or an LM mode (default: %(default)s; "
                         "--model lm: lm_equivalence)")
    ap.add_argument("--seed", type=int, default=11, help="seed of one run (default: %(default)s)")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), metavar="N",
                    help="seeds of --mode matrix (default: %(default)s)")
    _add_config_flags(ap, defaults)
    add_lm_flags(ap)
    if simulated:
        ap.add_argument("--simulate", choices=SIMULATIONS, default=SIMULATIONS[0],
                        help="fixture: the original fixture's model (rank 0's view, the "
                             "default JSON); ranks: every rank its own output, loss and "
                             "backward, as real ranks (default: %(default)s)")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 when any equivalence run did not pass")
    if simulated:  # the real-rank CLI compares with the original fixture's 1e-6
        ap.add_argument("--tolerance", choices=TOLERANCES, default="seed",
                        help="seed: absolute 1e-6; auto: a rounding bound per measure from the "
                             "dtype and the sizes of the sums, and a verdict pass / fail / "
                             "inconclusive (default: %(default)s)")
        ap.add_argument("--init", choices=INITS, default="seed",
                        help="weight init: seed (N(0,1) * 0.15) or fan_in (N(0,1) / "
                             "sqrt(fan_in)) (default: %(default)s)")
    ap.add_argument("--list-modes", action="store_true",
                    help="print the bug registry (name, description, citation, needs) as "
                         "JSON and exit; with --model lm the LM's")
    ap.add_argument("--diagnose", action="store_true",
                    help="add to each result a 'diagnosis': candidate causes ranked "
                         "from observables that need no dense model; with --model lm the "
                         "tier-1 observables the run shows")
    if simulated:
        ap.add_argument("--typecheck", action="store_true",
                        help="tier 0: type-check --mode's per-rank block with spmd_types on "
                             "a fake process group (nothing runs); print the verdict and the "
                             "checker's message as JSON")
    return ap


def config_from_args(args: argparse.Namespace) -> Config:
    """The Config named by the parsed flags, one per field (``ValueError`` when invalid)."""
    return Config(**{field.name: getattr(args, field.name) for field in fields(Config)})


def modes_listing() -> list[dict]:
    """``--list-modes``: ``zoo.list_modes()`` with each mode's ``lowest_tier`` and ``shows``."""
    from tpattn.bugs.zoo import list_modes
    from tpattn.diagnosis.diagnose import evidence_of, lowest_tier

    return [{**m, "lowest_tier": lowest_tier(m["name"]), "shows": evidence_of(m["name"])}
            for m in list_modes()]


def main(argv: list[str] | None = None, prog: str = "tpattn") -> int:
    """Run the CLI; returns the exit code."""
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    if args.model == "lm":
        return lm_cli(args, ap, prog)
    if args.list_modes:
        print(json.dumps(modes_listing(), indent=2))
        return 0
    try:
        check_block_args(args)
        cfg = config_from_args(args)
        if args.typecheck:
            if args.mode in ("inspect", "matrix") or args.diagnose:
                raise ValueError("--typecheck checks one --mode (not inspect or matrix) and "
                                 "cannot be combined with --diagnose")
            from tpattn.diagnosis.typecheck import typecheck

            print(json.dumps(typecheck(args.mode, cfg, args.seed), indent=2))
            return 0  # a caught bug is a result
        if args.mode == "inspect":
            out = inspect_fixture(cfg)
        elif args.mode == "matrix":
            out = run_matrix(args.seeds, modes_for(cfg), cfg, args.simulate,
                             tolerance=args.tolerance, init=args.init)
        else:
            out = run(args.seed, args.mode, cfg, args.simulate, tolerance=args.tolerance,
                      init=args.init)
        if args.diagnose:
            from tpattn.diagnosis.diagnose import diagnose
            from tpattn.diagnosis.observe import observe

            for result in _results(out):
                result["diagnosis"] = diagnose(observe(result["mode"], result["seed"], cfg))
    except ValueError as e:
        ap.exit(2, f"{prog}: error: {e}\n")
    return print_results(out, args.strict)


def lm_cli(args: argparse.Namespace, ap: argparse.ArgumentParser, prog: str) -> int:
    """``--model lm`` on simulated ranks: ``--list-modes`` the LM registry, else
    ``cli_lm.lm_main``'s JSON; bad input exits 2 with one line."""
    if args.list_modes:
        print(json.dumps(lm_listing(), indent=2))
        return 0
    try:
        out = lm_main(args, config_from_args(args))
    except ValueError as e:
        ap.exit(2, f"{prog}: error: {e}\n")
    return print_results(out, args.strict, LM_EQUIVALENCE)


def print_results(out, strict: bool, correct: str = EQUIVALENCE) -> int:
    """Print ``out`` as JSON; the exit code: 1 if ``strict`` and a ``correct`` run (correct
    TP's mode) failed."""
    print(json.dumps(out, indent=2))
    return int(strict and any(r["mode"] == correct and not r["passed"] for r in _results(out)))


def _results(out) -> list[dict]:
    """The run dicts in ``out``: a matrix's list, one run's dict, none for ``inspect``."""
    return out if isinstance(out, list) else [out] if out and "passed" in out else []


def console_main() -> None:
    """Entry point of the ``tpattn`` console script."""
    sys.exit(main())
