"""Execution time of every book notebook, each in a fresh kernel (target: < 20 s each).

Executes the notebooks the way the book build and nbval do (kernel started in book/ or the
notebook's folder), without writing anything back, and prints a table: kernel start + all
cells, wall seconds. Usage: python bench/notebook_times.py [NOTEBOOK ...]
"""
from __future__ import annotations

import pathlib
import sys
import time

import nbclient
import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT_S = 20.0


def execute(path: pathlib.Path) -> float:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    paths = [pathlib.Path(a).resolve() for a in argv] or sorted(
        p for p in (ROOT / "book").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    rows = []
    for p in paths:
        rows.append((p.relative_to(ROOT).as_posix(), execute(p)))
        print(f"{rows[-1][0]:<42} {rows[-1][1]:6.1f} s", flush=True)
    worst = max(t for _, t in rows)
    print(f"{len(rows)} notebooks, total {sum(t for _, t in rows):.1f} s, slowest {worst:.1f} s "
          f"(limit {LIMIT_S:.0f} s each): {'OK' if worst < LIMIT_S else 'OVER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
