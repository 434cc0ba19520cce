"""What each book notebook imports, and what it pays for it (a benchmark: exit status 0).

Every notebook under book/ is executed in a fresh kernel the way the book build and nbval run it
(kernel cwd = the notebook's folder; nothing is written back). After each code cell the same
kernel is asked which heavy modules are in ``sys.modules``, so the table says which cell first
loaded each one. Printed per notebook:

- ``total s``: kernel start + every cell (as ``bench/notebook_times.py`` measures it);
- ``start-up s``: kernel start to the end of the first code cell that imports torch or tpattn;
- the heavy modules loaded by the end, each marked ``unused`` when the notebook's code cells
  never use it (``USED_BY`` below: the names a cell must mention, or the outputs it must
  produce, for the module to count as used — e.g. ``torch.distributed.tensor`` loaded only
  through ``torch.testing.assert_close`` is unused).

Usage: python bench/notebook_imports.py [--json PATH] [NOTEBOOK ...]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time

import nbclient
import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: Modules that cost real start-up time (seconds, cold) and that ``import torch`` itself does
#: not load.
HEAVY = ("torch.distributed.tensor", "torch._dynamo", "matplotlib", "ipywidgets",
         "transformers", "hypothesis", "pandas", "scipy", "sympy")

#: A heavy module counts as used when a code cell's source matches this pattern (the module
#: itself, or a tpattn entry point that needs it) ...
USED_BY = {
    "torch.distributed.tensor": r"torch\.distributed\.tensor|DTensor|device_mesh|"
                                r"parallelize_module|dtensor_check|dtensor_sp|module_check|"
                                r"check_module|interop",
    "torch._dynamo": r"torch\.compile|_dynamo|torch\.export",
    "matplotlib": r"matplotlib|\bplt\.",
    "ipywidgets": r"ipywidgets",
    "transformers": r"transformers|interop",
    "hypothesis": r"hypothesis",
    "pandas": r"pandas|\bpd\.",
    "scipy": r"scipy",
    "sympy": r"sympy",
}
#: ... or when a cell's output is one of these (a figure drawn; a live widget shown, whose
#: explorers draw with matplotlib).
USED_BY_OUTPUT = {
    "matplotlib": ("image/png", "application/vnd.jupyter.widget-view+json"),
    "ipywidgets": ("application/vnd.jupyter.widget-view+json",),
}

_QUERY = ("import sys as _s, json as _j; print(_j.dumps([_m for _m in "
          + repr(list(HEAVY)) + " if _m in _s.modules]))")
_IMPORTS_TORCH = re.compile(r"^\s*(import|from)\s+(torch|tpattn)\b", re.M)


def _loaded(client: nbclient.NotebookClient) -> list[str]:
    """The heavy modules now in the kernel's ``sys.modules``, asked by a scratch cell at the
    end of the notebook (``execute_cell`` stores the cell it runs at its index)."""
    cell = nbformat.v4.new_code_cell(_QUERY)
    client.nb.cells.append(cell)
    try:
        client.execute_cell(cell, len(client.nb.cells) - 1, store_history=False)
    finally:
        client.nb.cells.pop()
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")
    return json.loads(text.strip().splitlines()[-1])


def _outputs(cell) -> set[str]:
    return {mime for o in cell.get("outputs", []) for mime in o.get("data", {})}


def used(nb, module: str) -> bool:
    """Whether ``nb``'s code cells (sources, or outputs after execution) use ``module``."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    # importing the module itself is not using it: drop those lines
    own_import = re.compile(rf"^\s*(import|from)\s+{re.escape(module.split('.')[0])}\b.*$", re.M)
    if any(re.search(USED_BY[module], own_import.sub("", c.source)) for c in code):
        return True
    mimes = set().union(*(_outputs(c) for c in code)) if code else set()
    return bool(mimes & set(USED_BY_OUTPUT.get(module, ())))


def _name(path: pathlib.Path) -> str:
    """``book/NN_x.ipynb``: the path from the folder above ``book/`` (any checkout)."""
    parts = path.parts
    return "/".join(parts[len(parts) - 1 - parts[::-1].index("book"):]) if "book" in parts \
        else path.name


def measure(path: pathlib.Path) -> dict:
    """Execute ``path`` in a fresh kernel; its times and heavy modules (see the module doc)."""
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(path.parent)}})
    first_loaded: dict[str, int] = {}
    startup = None
    t0 = time.perf_counter()
    with client.setup_kernel():
        kernel_s = time.perf_counter() - t0
        busy = 0.0  # time spent in our own queries, not charged to the notebook
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            client.execute_cell(cell, index)
            if startup is None and _IMPORTS_TORCH.search(cell.source):
                startup = time.perf_counter() - t0 - busy
            q0 = time.perf_counter()
            for module in _loaded(client):
                first_loaded.setdefault(module, index)
            busy += time.perf_counter() - q0
        total = time.perf_counter() - t0 - busy
    return {
        "notebook": _name(path),
        "total_s": round(total, 2),
        "kernel_start_s": round(kernel_s, 2),
        "startup_s": None if startup is None else round(startup, 2),
        "heavy": {m: {"first_cell": first_loaded[m], "used": used(nb, m)}
                  for m in HEAVY if m in first_loaded},
    }


def describe(row: dict) -> str:
    """``matplotlib, torch.distributed.tensor (unused, cell 12)``: the heavy-module column."""
    parts = [m if info["used"] else f"{m} (unused, cell {info['first_cell']})"
             for m, info in row["heavy"].items()]
    return ", ".join(parts) or "-"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path)
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or sorted(
        p for p in (ROOT / "book").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    rows = []
    print(f"{'notebook':<40} {'total s':>7} {'start-up s':>10}  heavy modules loaded")
    for path in paths:
        row = measure(path)
        rows.append(row)
        startup = "-" if row["startup_s"] is None else f"{row['startup_s']:.1f}"
        print(f"{row['notebook']:<40} {row['total_s']:7.1f} {startup:>10}  {describe(row)}",
              flush=True)
    unused = sum(not info["used"] for r in rows for info in r["heavy"].values())
    print(f"{len(rows)} notebooks, total {sum(r['total_s'] for r in rows):.1f} s; "
          f"{unused} unused heavy imports")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
