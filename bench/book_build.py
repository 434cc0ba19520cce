"""Cold book build against bare serial execution of the same notebooks (issue 15, figure 1).

Side by side, in one run, on the same machine and load:

1. *serial*: ``jupyter execute`` of every book notebook, one after another, each in the
   notebook's folder, nothing written back — the execution alone, no Sphinx;
2. *cold build*: ``jupyter-book build . --all -W -n --keep-going`` (what ``make book`` runs)
   into a fresh temporary ``--path-output``, so the execution cache starts empty — Sphinx,
   the parallel pre-execution of ``book/_ext/tpattn_book.py`` and the HTML writing included.

Prints both wall times, the process-tree CPU seconds, and ``cold / serial`` against the target
of 0.7; ``--json PATH`` writes them. A benchmark, not a test: exit status 0 unless a command
fails. On a machine busy with other work the wall times stretch; the ratio is the figure.

``--smoke``: step 1 alone, on one two-cell notebook written to a temporary folder (seconds);
no build, so no ratio (``null`` in the JSON).

    .venv/bin/python bench/book_build.py [--jobs N] [--json PATH] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TARGET_RATIO = 0.7


def notebooks() -> list[Path]:
    return sorted(p for p in (ROOT / "book").rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in p.parts)


def smoke_notebook(folder: Path) -> Path:
    """A two-cell notebook in ``folder`` (a print): the smoke case."""
    path = folder / "smoke.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("A smoke notebook."),
        nbformat.v4.new_code_cell("print(sum(range(10)))")]), path)
    return path


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmds: list[tuple[list[str], Path]], **kw) -> tuple[float, float]:
    """Run each ``(command, folder)`` one after another; (wall s, CPU s of their processes)."""
    cpu0, t0 = children_cpu(), time.perf_counter()
    for cmd, cwd in cmds:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       cwd=cwd, **kw)
    return time.perf_counter() - t0, children_cpu() - cpu0


def serial(nbs: list[Path]) -> tuple[float, float]:
    """Step 1: ``jupyter execute`` of each of ``nbs`` in its folder; (wall s, CPU s)."""
    wall, cpu = timed([([str(BIN / "jupyter"), "execute", "--kernel_name=python3", p.name],
                        p.parent) for p in nbs])
    print(f"serial jupyter execute, {len(nbs)} notebooks: {wall:6.1f} s wall "
          f"{cpu:6.1f} s CPU", flush=True)
    return wall, cpu


def cold_build(jobs: int | None) -> tuple[float, float]:
    """Step 2: ``make book``'s command into a fresh output folder; (wall s, CPU s)."""
    env = dict(os.environ)
    if jobs is not None:
        env["TPATTN_BOOK_JOBS"] = str(jobs)
    with tempfile.TemporaryDirectory(prefix="tpattn-cold-build-") as out:
        wall, cpu = timed(
            [([str(BIN / "jupyter-book"), "build", ".", "--all", "-W", "-n", "--keep-going",
               "--path-output", out], ROOT)], env=env)
    print(f"cold jupyter-book build (make book):      {wall:6.1f} s wall {cpu:6.1f} s CPU")
    return wall, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None,
                        help="TPATTN_BOOK_JOBS for the build (default: the extension's)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--smoke", action="store_true",
                        help="one two-cell notebook, no build: checks the script runs")
    args = parser.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            nbs = [smoke_notebook(Path(tmp))]
            serial_wall, serial_cpu = serial(nbs)
        build_wall = build_cpu = ratio = None
        print("cold jupyter-book build: not run (--smoke)")
    else:
        nbs = notebooks()
        serial_wall, serial_cpu = serial(nbs)
        build_wall, build_cpu = cold_build(args.jobs)
        ratio = build_wall / serial_wall
        print(f"cold build / serial execute = {ratio:.2f} (target <= {TARGET_RATIO}): "
              f"{'PASS' if ratio <= TARGET_RATIO else 'OVER'}  [{os.cpu_count()} CPUs]")
    if args.json:
        rounded = {k: None if v is None else round(v, n) for k, v, n in (
            ("serial_execute_s", serial_wall, 1), ("serial_execute_cpu_s", serial_cpu, 1),
            ("cold_build_s", build_wall, 1), ("cold_build_cpu_s", build_cpu, 1),
            ("ratio", ratio, 3))}
        args.json.write_text(json.dumps({"notebooks": len(nbs), "cpus": os.cpu_count(),
                                         **rounded, "target": TARGET_RATIO}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
