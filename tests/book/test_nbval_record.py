"""One execution for nbval and the book: ``tools/nbval_record.py`` keeps what nbval executed,
``book/_ext/tpattn_book.py`` caches it for myst-nb only when it is this package's and these
code cells' complete run."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest
from jupyter_cache import get_cache

from .test_book_build import load_book_extension

ROOT = Path(__file__).resolve().parents[2]
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def notebook(*cells: tuple[str, list]) -> nbformat.NotebookNode:
    """A notebook of code cells ``(source, committed outputs)`` (a string: stdout), marked as
    executed."""
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": KERNELSPEC})
    for count, (source, outputs) in enumerate(cells, start=1):
        nb.cells.append(nbformat.v4.new_code_cell(source, execution_count=count, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text=o) if isinstance(o, str) else o
            for o in outputs]))
    return nb


def test_nbval_keeps_each_passing_notebook_with_the_outputs_it_compared(tmp_path):
    book = tmp_path / "book"
    book.mkdir()
    nbformat.write(notebook(("print('left')", ["left\n"]),
                            ("import os\nprint(os.path.basename(os.getcwd()))", ["book\n"]),
                            ("6 * 7", [nbformat.v4.new_output(
                                "execute_result", data={"text/plain": "42"}, execution_count=3)])),
                   book / "good.ipynb")
    nbformat.write(notebook(("print('new')", ["old\n"])), book / "stale.ipynb")
    record = tmp_path / "rec"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-p", "tools.nbval_record", "--record-executed", str(record), f"--rootdir={tmp_path}",
         "--nbval", "--nbval-current-env", "book"],
        cwd=tmp_path, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert "1 failed, 3 passed" in run.stdout, run.stdout[-2000:]
    digest = load_book_extension().package_digest()
    written = sorted(p.relative_to(record) for p in record.rglob("*.ipynb"))
    assert written == [Path(digest, "book", "good.ipynb")]  # stale.ipynb failed: not kept
    kept = nbformat.read(record / written[0], as_version=4)
    assert [c.execution_count for c in kept.cells] == [1, 2, 3]
    assert kept.cells[1].outputs[0]["text"] == "book\n"  # ran in the notebook's folder
    result = kept.cells[2].outputs[0]
    assert result["output_type"] == "execute_result" and result["data"]["text/plain"] == "42"
    assert result["execution_count"] == 3 and kept.metadata.language_info["name"] == "python"


def test_the_book_caches_a_recorded_run_only_if_it_is_this_packages_complete_run(
        tmp_path, monkeypatch):
    ext = load_book_extension()
    src = tmp_path / "src"
    (src / "book").mkdir(parents=True)
    recorded = src / "_build" / "nbval-executed"  # beside the build's html folder
    here = recorded / ext.package_digest() / "book"
    here.mkdir(parents=True)
    cases = {  # name: (the notebook now, what nbval recorded, cached from the record?)
        "same": (notebook(("print(1)", [])), notebook(("print(1)", ["recorded\n"])), True),
        "edited": (notebook(("print(2)", [])), notebook(("print(1)", ["recorded\n"])), False),
        "partial": (notebook(("a = 1", []), ("print(a)", [])),
                    notebook(("a = 1", []), ("print(a)", ["recorded\n"])), False),
    }
    cases["partial"][1].cells[1].execution_count = None
    for name, (now, record, _) in cases.items():
        nbformat.write(now, src / "book" / f"{name}.ipynb")
        nbformat.write(record, here / f"{name}.ipynb")
    (recorded / "0123456789abcdef" / "book").mkdir(parents=True)  # another package's run
    nbformat.write(notebook(("print(3)", ["recorded\n"])),
                   recorded / "0123456789abcdef" / "book" / "other.ipynb")
    nbformat.write(notebook(("print(3)", [])), src / "book" / "other.ipynb")
    config = types.SimpleNamespace(
        nb_execution_mode="cache", nb_execution_cache_path=str(tmp_path / "cache"),
        nb_execution_timeout=60, nb_execution_allow_errors=False, exclude_patterns=["_build"])
    monkeypatch.setenv("TPATTN_BOOK_JOBS", "1")  # cache what was recorded, execute nothing
    app = types.SimpleNamespace(srcdir=str(src), outdir=str(src / "_build" / "html"), config=config)
    ext.prefill_execution_cache(app, config)
    cache = get_cache(config.nb_execution_cache_path)
    for name, cached in [*((n, c[2]) for n, c in cases.items()), ("other", False)]:
        now = nbformat.read(src / "book" / f"{name}.ipynb", as_version=4)
        if not cached:
            with pytest.raises(KeyError):
                cache.match_cache_notebook(now)
            continue
        nb = cache.get_cache_bundle(cache.match_cache_notebook(now).pk).nb
        assert nb.cells[0].outputs[0]["text"] == "recorded\n"
