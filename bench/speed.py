"""Issue 15's four figures, one after another on this machine, then a summary.

1. cold ``make book`` / bare serial ``jupyter execute`` (bench/book_build.py; target <= 0.7);
2. ``make test`` with a warm venv (bench/test_time.py; target <= 6 min on 2 cores) —
   ``--ci`` adds ``bash .ci/run`` from a fresh clone (target <= 20 min; about that long);
3. every live explorer's redraw p95 and max (bench/widget_latency.py; targets <= 50 and
   <= 100 ms, issue 27);
4. per-notebook start-up and heavy imports a notebook does not use (bench/notebook_imports.py;
   target: none).

``make bench`` runs this first. A benchmark, not a test: exit status 0 unless a script fails.
``--smoke`` runs each script with ``--smoke`` (seconds; figure 1 then has no ratio).

    .venv/bin/python bench/speed.py [--ci] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def run(script: str, out: Path, *extra: str) -> dict:
    print(f"-- {script} {' '.join(extra)}".rstrip(), flush=True)
    subprocess.run([sys.executable, str(BENCH / script), "--json", str(out), *extra], check=True)
    return json.loads(out.read_text())


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ci", action="store_true", help="also time .ci/run in a fresh clone")
    parser.add_argument("--smoke", action="store_true",
                        help="run each script with --smoke: checks they run, in seconds")
    args = parser.parse_args()
    smoke = ("--smoke",) if args.smoke else ()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        book = run("book_build.py", tmp / "book.json", *smoke)
        tests = run("test_time.py", tmp / "test.json", *smoke)
        ci = run("test_time.py", tmp / "ci.json", "--ci") if args.ci else None
        widgets = run("widget_latency.py", tmp / "widgets.json", *smoke)
        imports = run("notebook_imports.py", tmp / "imports.json", *smoke)
    print("\n== issue 15: the four figures" + (" (--smoke: not the figures)" if smoke else ""))
    ratio = "not measured" if book["ratio"] is None else f"{book['ratio']:.2f}"
    print(f"1. cold make book / serial execute: {ratio} "
          f"({_seconds(book['cold_build_s'])} / {_seconds(book['serial_execute_s'])}; "
          f"target <= 0.7)")
    line = f"2. make test, warm venv: {tests['make_test_s'] / 60:.1f} min (target <= 6)"
    if "test_lab_s" in tests:
        line += f"; make test-lab (CI only): {tests['test_lab_s'] / 60:.1f} min"
    if ci:
        line += f"; .ci/run, fresh clone: {ci['ci_run_s'] / 60:.1f} min (target <= 20)"
    print(line)
    name, worst = max(widgets["explorers"].items(), key=lambda kv: kv[1]["wall_ms"]["p95"])
    over = [n for n, r in widgets["explorers"].items() if r["verdict"] != "PASS"]
    print(f"3. explorer redraw p95, worst: {worst['wall_ms']['p95']:.0f} ms wall, "
          f"{worst['cpu_ms']['p95']:.0f} ms CPU ({name}); over p95 50 / max 100 ms (wall): "
          f"{len(over)} of {len(widgets['explorers'])}")
    unused = {row["notebook"]: [m for m, i in row["heavy"].items() if i["needed"] is None]
              for row in imports}
    unused = {k: v for k, v in unused.items() if v}
    print(f"4. notebooks importing a heavy module they do not use: {len(unused)}"
          + (f" {unused}" if unused else "") + " (target: 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
