"""A pytest plugin: keep nbval's execution of each notebook, so the book build need not repeat it.

``make test`` runs pytest with ``-p tools.nbval_record --record-executed DIR``. nbval executes
every notebook from scratch, in one kernel per notebook, in the notebook's own folder (as the
book build does) and compares each cell's outputs with the committed ones. When every code cell
of a notebook has passed, this plugin writes that notebook with the outputs the kernel just
produced (``IPyNbCell.test_outputs``, the very outputs nbval compared) and their execution
counts to ``DIR/<package digest>/<path from the rootdir>.ipynb``. The book extension
(``book/_ext/tpattn_book.py``) then caches it for myst-nb instead of executing the notebook a
second time, only if the digest of ``tpattn/`` is still the same and the notebook's code cells
are unchanged (jupyter-cache's own hash). A notebook with a failed or skipped cell is not
written: the book executes it itself.

Without ``--record-executed`` the plugin does nothing.
"""
from __future__ import annotations

import copy
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def package_digest() -> str:
    """The book extension's digest of ``tpattn/`` (one definition: its module, loaded by path)."""
    spec = importlib.util.spec_from_file_location("tpattn_book", ROOT / "book" / "_ext" / "tpattn_book.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.package_digest()


def pytest_addoption(parser):
    parser.addoption("--record-executed", metavar="DIR", default=None,
                     help="write each notebook nbval ran without a failure, with its new "
                          "outputs, under DIR/<digest of tpattn/> (for the book build)")


class Recorder:
    """Per notebook: the outputs of each code cell that passed, until all have."""

    def __init__(self, folder: pathlib.Path, digest: str, root: pathlib.Path):
        self.folder, self.root = folder / digest, root
        self.passed: dict[str, dict[int, list]] = {}
        self.written: list[pathlib.Path] = []

    def cell_passed(self, item) -> None:
        notebook = item.parent
        outputs = self.passed.setdefault(notebook.nodeid, {})
        outputs[item.cell_num] = copy.deepcopy(item.test_outputs)
        code_cells = [c for c in notebook.nb.cells if c.cell_type == "code"]
        if len(outputs) == len(code_cells):
            self.write(notebook, code_cells, outputs)

    def write(self, notebook, code_cells, outputs) -> None:
        import nbformat
        from ipykernel.ipkernel import IPythonKernel

        nb = copy.deepcopy(notebook.nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        for count, (cell, num) in enumerate(zip(code, sorted(outputs)), start=1):
            cell.outputs = [nbformat.from_dict(o) for o in outputs[num]]
            cell.execution_count = count
            for output in cell.outputs:
                if output.output_type == "execute_result":
                    output.execution_count = count
                    output.setdefault("metadata", {})
        nb.metadata["language_info"] = dict(IPythonKernel.language_info)
        target = self.folder / pathlib.Path(str(notebook.path)).resolve().relative_to(self.root)
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, target)
        self.written.append(target)


_recorder: Recorder | None = None


def pytest_configure(config):
    global _recorder
    folder = config.getoption("--record-executed")
    if folder:
        _recorder = Recorder(pathlib.Path(folder).resolve(), package_digest(),
                             config.rootpath.resolve())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (_recorder is not None and call.when == "call" and report.passed
            and type(item).__name__ == "IPyNbCell"):
        _recorder.cell_passed(item)
