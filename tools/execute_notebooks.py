"""Re-execute the book's notebooks in place, several at a time, then clean them.

Stored outputs are what nbval compares against, so after a change to the package every
notebook that shows or uses the changed code must be executed again. This runs them in
parallel (one kernel per worker, ``--jobs`` workers, default: the number of CPUs), each in
its own directory as the book build does, then applies ``tools/clean_notebooks.py``.

    python tools/execute_notebooks.py                 # every notebook of the book
    python tools/execute_notebooks.py book/07_*.ipynb --jobs 1
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds per cell: a hang fails the run instead of stalling it


def book_notebooks() -> list[Path]:
    """Every notebook under ``book/`` (chapters and appendix), in name order."""
    return sorted(p for p in (ROOT / "book").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def execute(path: str) -> tuple[str, float, str | None]:
    """Execute one notebook in place; returns (path, seconds, error or None)."""
    import nbformat
    from nbclient import NotebookClient

    start = time.monotonic()
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # timestamps of an earlier run: noise in every diff
        cell.metadata.pop("execution", None)
    client = NotebookClient(nb, timeout=TIMEOUT, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(Path(path).parent)}})
    try:
        client.execute()
    except Exception as e:  # report and go on: the other notebooks still run
        return path, time.monotonic() - start, f"{type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}"
    nbformat.write(nb, path)
    return path, time.monotonic() - start, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook in book/")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="notebooks at a time")
    args = ap.parse_args(argv)
    paths = [str(p.resolve()) for p in (args.notebooks or book_notebooks())]
    # the longest first, so that the last worker is not left with the slowest alone
    paths.sort(key=lambda p: -Path(p).stat().st_size)
    failed = []
    start = time.monotonic()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for path, seconds, error in pool.map(execute, paths):
            name = Path(path).relative_to(ROOT)
            print(f"{seconds:6.1f} s  {name}" + (f"  FAILED: {error}" if error else ""), flush=True)
            if error:
                failed.append(name)
    print(f"{time.monotonic() - start:6.1f} s  in all, {len(paths)} notebooks, {args.jobs} at a time")
    subprocess.run([sys.executable, str(ROOT / "tools" / "clean_notebooks.py"), *paths], check=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
