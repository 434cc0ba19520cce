"""``python -m tpattn`` / ``tpattn``: the seed's command line, plus Config flags.

Prints the seed's JSON (same keys, order and indent). Exit codes: 0 when the run completed
(a failing check is a result, not an error); 1 with ``--strict`` when an ``equivalence`` run
did not pass; 2 for bad arguments or an invalid Config (one line on stderr, no traceback).
"""
from __future__ import annotations

import argparse
import json
import sys

from .check import EQUIVALENCE, MODES, SEEDS, inspect_fixture, run, run_matrix
from .config import DTYPES, Config
from .tolerance import TOLERANCES

CLI_MODES = ("inspect",) + MODES + ("matrix",)
_CONFIG_FLAGS = ("seq", "batch", "hidden", "query_heads", "kv_heads", "head_dim", "world_size")


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (``tpattn: error: …``) and exit 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog: str = "tpattn") -> argparse.ArgumentParser:
    """The argument parser (also used to document the CLI in the book)."""
    defaults = Config()
    ap = _OneLineParser(prog=prog, description=(
        "Compare a dense attention block with its tensor-parallel version on five measures "
        "(forward, loss, input grad, parameter grads, weights after one SGD step)."))
    ap.add_argument("--mode", choices=CLI_MODES, default=EQUIVALENCE,
                    help="what to run (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=11, help="seed of one run (default: %(default)s)")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), metavar="N",
                    help="seeds of --mode matrix (default: %(default)s)")
    for name in _CONFIG_FLAGS:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name),
                        metavar="N", help=f"Config.{name} (default: %(default)s)")
    ap.add_argument("--eps", type=float, default=defaults.eps, help="Config.eps (default: %(default)s)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=defaults.dtype,
                    help="Config.dtype (default: %(default)s)")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 when any equivalence run did not pass")
    ap.add_argument("--tolerance", choices=TOLERANCES, default="seed",
                    help="seed: absolute 1e-6; auto: a rounding bound per measure from the "
                         "dtype and the sizes of the sums (default: %(default)s)")
    return ap


def config_from_args(args: argparse.Namespace) -> Config:
    """The Config named by the parsed flags (raises ``ValueError`` when invalid)."""
    return Config(**{name: getattr(args, name) for name in _CONFIG_FLAGS},
                  eps=args.eps, dtype=args.dtype)


def main(argv: list[str] | None = None, prog: str = "tpattn") -> int:
    """Run the CLI; returns the exit code."""
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    try:
        cfg = config_from_args(args)
        if args.mode == "inspect":
            out = inspect_fixture(cfg)
        elif args.mode == "matrix":
            out = run_matrix(args.seeds, MODES, cfg, tolerance=args.tolerance)
        else:
            out = run(args.seed, args.mode, cfg, tolerance=args.tolerance)
    except ValueError as e:
        ap.exit(2, f"{prog}: error: {e}\n")
    print(json.dumps(out, indent=2))
    results = out if isinstance(out, list) else [out] if "passed" in out else []
    if args.strict and any(r["mode"] == EQUIVALENCE and not r["passed"] for r in results):
        return 1
    return 0


def console_main() -> None:
    """Entry point of the ``tpattn`` console script."""
    sys.exit(main())
