"""Execution time of every book notebook, each in a fresh kernel (target: < 20 s each).

Executes the notebooks the way the book build and nbval do (kernel started in book/ or the
notebook's folder), without writing anything back, and prints a table: kernel start + all
cells, wall seconds. ``--smoke`` executes one two-cell notebook written to a temporary folder
instead (a print: seconds).

    python bench/notebook_times.py [NOTEBOOK ...] [--smoke]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import nbclient
import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT_S = 20.0


def smoke_notebook(folder: pathlib.Path) -> pathlib.Path:
    """A two-cell notebook in ``folder`` (a print): the smoke case."""
    path = folder / "smoke.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("A smoke notebook."),
        nbformat.v4.new_code_cell("print(sum(range(10)))")]), path)
    return path


def execute(path: pathlib.Path) -> float:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()
    return time.perf_counter() - t0


def _label(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def table(paths: list[pathlib.Path]) -> None:
    """Execute each of ``paths``; print one row each, then the total and the slowest."""
    rows = []
    for p in paths:
        rows.append((_label(p), execute(p)))
        print(f"{rows[-1][0]:<42} {rows[-1][1]:6.1f} s", flush=True)
    worst = max(t for _, t in rows)
    print(f"{len(rows)} notebooks, total {sum(t for _, t in rows):.1f} s, slowest {worst:.1f} s "
          f"(limit {LIMIT_S:.0f} s each): {'OK' if worst < LIMIT_S else 'OVER'}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path,
                        help="notebooks to time (default: every book notebook)")
    parser.add_argument("--smoke", action="store_true",
                        help="one two-cell notebook instead: checks the script runs, in seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            table([smoke_notebook(pathlib.Path(tmp))])
        return 0
    table([p.resolve() for p in args.notebooks] or sorted(
        p for p in (ROOT / "book").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
