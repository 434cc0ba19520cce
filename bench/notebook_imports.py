"""What each book notebook imports, and what it pays for it (a benchmark: exit status 0).

Every notebook under book/ is executed in a fresh kernel the way the book build and nbval run it
(kernel cwd = the notebook's folder; nothing is written back). After each code cell the same
kernel is asked which heavy modules are in ``sys.modules``, so the table says which cell first
loaded each one. Printed per notebook:

- ``total s``: kernel start + every cell, wall (as ``bench/notebook_times.py`` measures it);
- ``cpu s``: the kernel process's own CPU time (user + system) at the end: on a shared machine
  it moves less with other load than wall time does;
- ``start-up s``: kernel start to the end of the first code cell that imports torch or tpattn;
- the heavy modules loaded by the end, each marked ``unused`` when nothing in the notebook needs
  it: its code cells never use it (``USED_BY``: the names a cell must mention or the outputs it
  must produce), no call needs it (``needs_sympy``) and no used heavy module imports it
  (measured once per run in a fresh interpreter). E.g. ``torch.distributed.tensor`` loaded only
  by the first ``torch.testing.assert_close`` call is unused.

``--compare A B`` runs every notebook of checkout A with ``PYTHONPATH=A`` and the same
notebook of checkout B with ``PYTHONPATH=B`` back to back (A first, then B first for the next
notebook), so both sides share the machine's load: the before/after table of one run.

``--smoke`` measures one two-cell notebook written to a temporary folder instead (seconds).

Usage: python bench/notebook_imports.py [--json PATH] [--compare A B] [--smoke] [NOTEBOOK ...]
(NOTEBOOK names are relative to a checkout, e.g. book/02_rmsnorm.ipynb; default: all.)
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import re
import sys
import tempfile
import time

import nbclient
import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: Modules that cost real start-up time and that ``import torch`` itself does not load.
HEAVY = ("torch.distributed.tensor", "torch._dynamo", "matplotlib", "ipywidgets",
         "transformers", "hypothesis", "pandas", "scipy", "sympy")

#: A heavy module counts as used when a code cell's source matches this pattern (the module
#: itself, or a tpattn entry point that needs it; a line importing the module is not a use) ...
USED_BY = {
    "torch.distributed.tensor": r"torch\.distributed\.tensor|DTensor|device_mesh|"
                                r"parallelize_module|dtensor_check|dtensor_sp|module_check|"
                                r"check_module|interop",
    "torch._dynamo": r"torch\.compile|_dynamo|torch\.export",
    "matplotlib": r"matplotlib|\bplt\.",
    "ipywidgets": r"ipywidgets|tpattn\.widgets|\bwidgets\.\w+explorer",
    "transformers": r"transformers|interop",
    "hypothesis": r"hypothesis",
    "pandas": r"pandas|\bpd\.",
    "scipy": r"scipy",
    "sympy": r"sympy",
}
#: ... or when a cell's output has one of these types (a figure drawn; a live widget shown) ...
USED_BY_OUTPUT = {
    "matplotlib": ("image/png",),
    "ipywidgets": ("application/vnd.jupyter.widget-view+json",),
}
#: ... or an HTML output holds this (an explorer's static twin: PNGs drawn with matplotlib).
USED_BY_HTML = {"matplotlib": "data:image/png"}

_QUERY = ("import sys as _s, json as _j, resource as _r; _u = _r.getrusage(_r.RUSAGE_SELF); "
          "print(_j.dumps([[_m for _m in " + repr(list(HEAVY)) + " if _m in _s.modules], "
          "_u.ru_utime + _u.ru_stime]))")
_IMPORTS_TORCH = re.compile(r"^\s*(import|from)\s+(torch|tpattn)\b", re.M)


def needs_sympy(source: str) -> bool:
    """Whether ``source`` calls autograd with explicit output gradients:
    ``t.backward(g)`` or ``torch.autograd.grad(out, x, g)`` (torch 2.13's shape check of
    ``g`` imports ``torch.fx.experimental.symbolic_shapes``, hence sympy)."""
    code = "\n".join(line for line in source.splitlines()
                     if not line.lstrip().startswith(("%", "!")))
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            keywords = {k.arg for k in node.keywords}
            if node.func.attr == "backward" and (node.args or "gradient" in keywords):
                return True
            if node.func.attr == "grad" and (len(node.args) >= 3 or "grad_outputs" in keywords):
                return True
    return False


_DEPENDENCIES: dict[str, list[str]] = {}
#: What the dependency probe imports for a module (its submodules the package uses).
PROBE = {"torch.distributed.tensor": "import torch.distributed.tensor.parallel, "
                                     "torch.distributed.tensor.debug"}


def pulled_in_by(module: str) -> list[str]:
    """The other heavy modules that importing ``module`` loads, measured in a fresh kernel
    (a kernel, not a plain interpreter: e.g. tqdm, under transformers, imports ipywidgets only
    there). Cached for the run."""
    if module not in _DEPENDENCIES:
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
            f"import torch\n{PROBE.get(module, f'import {module}')}")])
        client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300)
        with client.setup_kernel():
            client.execute_cell(nb.cells[0], 0)
            _DEPENDENCIES[module] = [m for m in _loaded(client) if m != module]
    return _DEPENDENCIES[module]


def _loaded(client: nbclient.NotebookClient) -> list[str]:
    """The heavy modules now in the kernel's ``sys.modules``."""
    return _ask(client)[0]


def _ask(client: nbclient.NotebookClient) -> tuple[list[str], float]:
    """The heavy modules now in the kernel's ``sys.modules`` and the kernel process's CPU
    seconds so far (user + system: less moved by other load on the machine than wall time),
    asked by a scratch cell at the end of the notebook (``execute_cell`` stores the cell it
    runs at its index)."""
    cell = nbformat.v4.new_code_cell(_QUERY)
    client.nb.cells.append(cell)
    try:
        client.execute_cell(cell, len(client.nb.cells) - 1, store_history=False)
    finally:
        client.nb.cells.pop()
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")
    modules, cpu = json.loads(text.strip().splitlines()[-1])
    return modules, cpu


def _outputs(cell) -> set[str]:
    return {mime for o in cell.get("outputs", []) for mime in o.get("data", {})}


def used_directly(nb, module: str) -> bool:
    """Whether ``nb``'s code cells (sources, or outputs after execution) use ``module``."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    # importing the module itself is not using it: drop those lines
    own_import = re.compile(rf"^\s*(import|from)\s+{re.escape(module.split('.')[0])}\b.*$",
                            re.M)
    if any(re.search(USED_BY[module], own_import.sub("", c.source)) for c in code):
        return True
    if module == "sympy" and any(needs_sympy(c.source) for c in code):
        return True
    mimes = set().union(*(_outputs(c) for c in code)) if code else set()
    if mimes & set(USED_BY_OUTPUT.get(module, ())):
        return True
    marker = USED_BY_HTML.get(module)
    return marker is not None and any(
        marker in "".join(o.get("data", {}).get("text/html", ""))
        for c in code for o in c.get("outputs", []))


def usage(nb, loaded: list[str]) -> dict[str, str | None]:
    """For each loaded heavy module: ``None`` if unused, else why it is needed."""
    direct = {m for m in loaded if used_directly(nb, m)}
    why: dict[str, str | None] = {m: "used" for m in direct}
    for m in loaded:
        if m not in why:
            via = [d for d in sorted(direct) if m in pulled_in_by(d)]
            why[m] = f"via {via[0]}" if via else None
    return why


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
            modules, cpu = _ask(client)
            for module in modules:
                first_loaded.setdefault(module, index)
            busy += time.perf_counter() - q0
        total = time.perf_counter() - t0 - busy
    why = usage(nb, list(first_loaded))
    return {
        "notebook": _name(path),
        "total_s": round(total, 2),
        "kernel_cpu_s": round(cpu, 2),
        "kernel_start_s": round(kernel_s, 2),
        "startup_s": None if startup is None else round(startup, 2),
        "heavy": {m: {"first_cell": first_loaded[m], "needed": why[m]}
                  for m in HEAVY if m in first_loaded},
    }


def describe(row: dict) -> str:
    """``matplotlib, sympy (via torch.distributed.tensor), torch.distributed.tensor (unused,
    cell 12)``: the heavy-module column."""
    parts = []
    for m, info in row["heavy"].items():
        if info["needed"] is None:
            parts.append(f"{m} (UNUSED, cell {info['first_cell']})")
        elif info["needed"] != "used":
            parts.append(f"{m} ({info['needed']})")
        else:
            parts.append(m)
    return ", ".join(parts) or "-"


def _unused(row: dict) -> int:
    return sum(info["needed"] is None for info in row["heavy"].values())


def _run(path: pathlib.Path, pythonpath: str | None) -> dict:
    """``measure`` with the kernel (a child of this process) on ``pythonpath``."""
    old = os.environ.get("PYTHONPATH")
    if pythonpath is not None:
        os.environ["PYTHONPATH"] = pythonpath
    try:
        return measure(path)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def smoke_notebook(folder: pathlib.Path) -> pathlib.Path:
    """A two-cell notebook in ``folder`` (a print): the smoke case."""
    path = folder / "smoke.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("A smoke notebook."),
        nbformat.v4.new_code_cell("print(sum(range(10)))")]), path)
    return path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="e.g. book/02_rmsnorm.ipynb")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    parser.add_argument("--compare", nargs=2, type=pathlib.Path, metavar=("A", "B"),
                        help="two checkouts, run alternately, each on its own PYTHONPATH")
    parser.add_argument("--smoke", action="store_true",
                        help="one two-cell notebook instead: checks the script runs, in seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            args.notebooks = [smoke_notebook(pathlib.Path(tmp)).name]
            return report(args, [pathlib.Path(tmp)])
    return report(args, [t.resolve() for t in args.compare] if args.compare else [ROOT])


def report(args, trees: list[pathlib.Path]) -> int:
    """Measure ``args.notebooks`` (default: every book notebook of ``trees[0]``) in each of
    ``trees`` and print the table (see the module doc); write ``args.json`` if given."""
    names = args.notebooks or sorted(
        p.relative_to(trees[0]).as_posix() for p in (trees[0] / "book").rglob("*.ipynb")
        if ".ipynb_checkpoints" not in p.parts)
    rows: dict[str, list[dict]] = {str(t): [] for t in trees}
    if args.compare:
        print(f"A = {trees[0]}\nB = {trees[1]}")
        print(f"{'notebook':<36} {'A s':>5} {'B s':>5} {'A cpu':>5} {'B cpu':>5} {'A up':>5} "
              f"{'B up':>5}  heavy modules A | B")
    else:
        print(f"{'notebook':<40} {'total s':>7} {'cpu s':>6} {'start-up s':>10}  "
              f"heavy modules loaded")
    for number, name in enumerate(names):
        measured = {}
        # alternate which side runs first, so neither always meets the other's leftovers
        for tree in (trees if number % 2 == 0 else trees[::-1]):
            path = tree / name
            measured[tree] = (_run(path, str(tree) if args.compare else None)
                              if path.exists() else None)
        side = [measured[tree] for tree in trees]
        for tree, row in zip(trees, side):
            rows[str(tree)].append(row)
        if not args.compare:
            row = side[0]
            up = "-" if row["startup_s"] is None else f"{row['startup_s']:.1f}"
            print(f"{row['notebook']:<40} {row['total_s']:7.1f} {row['kernel_cpu_s']:6.1f} "
                  f"{up:>10}  {describe(row)}", flush=True)
            continue
        def col(key):
            return [f"{r[key]:5.1f}" if r and r[key] is not None else f"{'-':>5}" for r in side]
        heavy = " | ".join(describe(r) if r else "-" for r in side)
        print(f"{name:<36} {' '.join(col('total_s'))} {' '.join(col('kernel_cpu_s'))} "
              f"{' '.join(col('startup_s'))}  {heavy}", flush=True)
    for tree in trees:
        done = [r for r in rows[str(tree)] if r]
        print(f"{tree}: {len(done)} notebooks, total {sum(r['total_s'] for r in done):.1f} s, "
              f"kernel CPU {sum(r['kernel_cpu_s'] for r in done):.1f} s, "
              f"start-up {sum(r['startup_s'] or 0 for r in done):.1f} s; "
              f"{sum(_unused(r) for r in done)} unused heavy imports")
    if args.json:
        payload = rows[str(trees[0])] if not args.compare else rows
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
