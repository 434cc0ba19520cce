"""Sphinx glue for the tpattn book (loaded from ``_config.yml`` → ``sphinx.local_extensions``).

What the stock Jupyter Book does not do:

1. ``tpattn-figure`` directive — embeds a figure that a ``tpattn.viz`` function draws *at build
   time*, so a markdown page (the landing page) shows a figure generated from the package's code,
   never a stale committed image::

       ```{tpattn-figure} tpattn.viz.overview.block_map_figure
       :alt: what the figure shows
       :width: 100%

       The caption.
       ```

   The PNG is inlined as a ``data:`` URI (no file to keep in sync, nothing external), and the
   function's module is recorded as a dependency, so editing it rebuilds the page.

2. Notebook re-execution when the package changes — ``execute_notebooks: cache`` keys its cache
   on a notebook's code cells only, so after a change to ``tpattn/`` it would keep serving old
   outputs. The cache directory gets a hash of ``tpattn/**/*.py`` in its name: a changed
   package means a fresh cache (every notebook runs again) and a changed Sphinx config (every
   page is read again).

3. Parallel execution — myst-nb executes the notebooks a build needs one after another, while
   Sphinx reads the pages. Before reading starts, every notebook the cache lacks is executed
   by ``jupyter_cache``'s own parallel worker (``local-parallel``: in the notebook's folder, as
   myst-nb does) in ``TPATTN_BOOK_JOBS`` processes (default: the CPU count, at most 8) and
   cached, so myst-nb finds each one in the cache. A notebook that fails there is not cached:
   myst-nb then executes it itself and reports the error as always (``-W`` fails the build).
   ``TPATTN_BOOK_JOBS=1`` leaves execution to myst-nb alone.

4. One execution for nbval and the book — ``make test`` runs nbval first, which executes every
   notebook from scratch and writes each one that passed, with the outputs it just compared,
   under ``_build/nbval-executed/<package digest>/`` (``tools/nbval_record.py``). A notebook
   missing from the cache whose recorded execution has this package's digest and the same code
   cells (jupyter-cache's hash) is cached from it, not executed again.

It also fails the build early, with the fix, when ``make setup`` has not fetched MathJax yet.
"""
from __future__ import annotations

import base64
import hashlib
import importlib
import io
import os
import sys
import time
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.errors import ConfigError
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tpattn"
#: Where ``make test``'s nbval run writes the notebooks it executed (``tools/nbval_record.py``),
#: next to the build's output folder (``_build/html``) and its execution cache.
RECORDED = "nbval-executed"


def package_digest() -> str:
    """Short sha256 of every ``tpattn/**/*.py`` (path and bytes), in sorted path order."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def key_cache_to_package(app: Sphinx, config: Config) -> None:
    """Point myst-nb's execution cache at ``_build/.jupyter_cache/tpattn-<digest>``."""
    cache_root = Path(app.outdir).parent / ".jupyter_cache"
    config.nb_execution_cache_path = str(cache_root / f"tpattn-{package_digest()}")


def execution_jobs() -> int:
    """``TPATTN_BOOK_JOBS`` (a positive integer), else the CPU count capped at 8."""
    raw = os.environ.get("TPATTN_BOOK_JOBS", "")
    if not raw:
        return max(1, min(8, os.cpu_count() or 1))
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"TPATTN_BOOK_JOBS must be a positive integer (got {raw!r})")
    return int(raw)


def book_notebooks(app: Sphinx) -> list[Path]:
    """Every ``.ipynb`` Sphinx will read: under the source folder, minus ``exclude_patterns``
    (a matching folder is pruned whole, as Sphinx does, so ``.venv`` is never walked)."""
    from sphinx.util.matching import Matcher

    excluded = Matcher(list(app.config.exclude_patterns) + ["**.ipynb_checkpoints"])
    source = Path(app.srcdir)
    found = []
    for folder, subfolders, files in os.walk(source):
        rel = Path(folder).relative_to(source)
        subfolders[:] = sorted(d for d in subfolders if not excluded((rel / d).as_posix()))
        found += [Path(folder) / f for f in files
                  if f.endswith(".ipynb") and not excluded((rel / f).as_posix())]
    return sorted(found)


def recorded_execution(app: Sphinx, path: Path, digest: str) -> Path | None:
    """Where ``make test``'s nbval run left its execution of notebook ``path``: a path under
    ``_build/nbval-executed/<digest>/`` (``digest``: the package's) that need not exist
    (``tools/nbval_record.py``);
    ``None`` for a notebook outside the source folder."""
    try:
        where = path.resolve().relative_to(Path(app.srcdir).resolve())
    except ValueError:
        return None
    return Path(app.outdir).parent / RECORDED / digest / where


def cache_recorded_execution(app: Sphinx, cache, path: Path, digest: str) -> bool:
    """Cache nbval's execution of ``path`` if one exists for this package and these code cells."""
    import nbformat
    from jupyter_cache.cache.main import CacheBundleIn

    recorded = recorded_execution(app, path, digest)
    if recorded is None or not recorded.is_file():
        return False
    executed = nbformat.read(recorded, as_version=4)
    current = nbformat.read(path, as_version=4)
    if cache.create_hashed_notebook(executed)[1] != cache.create_hashed_notebook(current)[1]:
        return False  # the notebook changed since nbval ran it
    code = [c for c in executed.cells if c.cell_type == "code"]
    if [c.execution_count for c in code] != list(range(1, len(code) + 1)):
        return False  # not one complete run
    cache.cache_notebook_bundle(CacheBundleIn(executed, str(path), data={"executed_by": "nbval"}),
                                check_validity=False, overwrite=True)
    return True


def prefill_execution_cache(app: Sphinx, config: Config) -> None:
    """Cache nbval's executions from ``make test``; execute the notebooks still missing from
    myst-nb's cache in parallel and cache them."""
    if config.nb_execution_mode != "cache":
        return
    jobs = execution_jobs()
    import multiprocessing

    import nbformat
    from jupyter_cache import get_cache
    from jupyter_cache.executors.basic import ExecutionWorkerLocalMProc, ProcessData
    from sphinx.util import logging

    logger = logging.getLogger(__name__)
    cache = get_cache(config.nb_execution_cache_path)
    todo, recorded, digest = [], 0, package_digest()
    for path in book_notebooks(app):
        try:
            cache.match_cache_notebook(nbformat.read(path, as_version=4))
        except KeyError:
            if cache_recorded_execution(app, cache, path, digest):
                recorded += 1
            else:
                todo.append(path)
    if recorded:
        logger.info(f"tpattn: {recorded} notebooks cached from nbval's run of them (make test)")
    if not todo or jobs == 1:
        return
    todo = [cache.add_nb_to_project(str(path)) for path in todo]
    workers = min(jobs, len(todo))
    logger.info(f"tpattn: executing {len(todo)} notebooks in {workers} processes")
    start = time.perf_counter()
    data = [ProcessData(r.pk, r.uri, cache, config.nb_execution_timeout,
                        config.nb_execution_allow_errors) for r in todo]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.map(ExecutionWorkerLocalMProc(), data, chunksize=1)
    failed = [uri for code, uri in results if code != 0]
    logger.info(f"tpattn: {len(todo) - len(failed)} notebooks executed and cached in "
                f"{time.perf_counter() - start:.1f} s" +
                (f"; left to myst-nb: {', '.join(failed)}" if failed else ""))


def require_vendored_assets(app: Sphinx, config: Config) -> None:
    """The book serves MathJax from ``vendor/`` (offline); say how to get it when it is missing."""
    mathjax = ROOT / "vendor" / "mathjax" / "tex-chtml.js"
    if not mathjax.is_file():
        raise ConfigError(f"{mathjax.relative_to(ROOT)} is missing: run `make setup` "
                          "(it fetches MathJax from the npm registry) before building the book")


class TpattnFigure(SphinxDirective):
    """``{tpattn-figure} module.function`` — call it (no arguments), embed the Figure it returns."""

    required_arguments = 1
    has_content = True
    option_spec = {"alt": directives.unchanged, "width": directives.length_or_percentage_or_unitless,
                   "name": directives.unchanged, "dpi": directives.positive_int}

    def run(self) -> list[nodes.Node]:
        dotted = self.arguments[0]
        module_name, _, func_name = dotted.rpartition(".")
        try:
            module = importlib.import_module(module_name)
            func = getattr(module, func_name)
        except (ImportError, AttributeError, ValueError) as err:
            raise self.error(f"tpattn-figure: cannot import {dotted!r}: {err}") from err
        self.env.note_dependency(module.__file__)

        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = func()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=self.options.get("dpi", 150),
                    metadata={"Software": None})  # no version string: same code, same bytes
        plt.close(fig)
        uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")

        image = nodes.image(uri=uri, alt=self.options.get("alt", dotted), candidates={"?": uri})
        if "width" in self.options:
            image["width"] = self.options["width"]
        figure = nodes.figure("", image, classes=["tpattn-figure"])
        if self.content:
            caption_nodes, _ = self.parse_inline("\n".join(self.content), lineno=self.content_offset)
            figure += nodes.caption("", "", *caption_nodes)
        self.add_name(figure)
        return [figure]


def setup(app: Sphinx) -> dict:
    if str(ROOT) not in sys.path:  # autodoc and the directive import the working tree's tpattn
        sys.path.insert(0, str(ROOT))
    app.connect("config-inited", require_vendored_assets)
    app.connect("config-inited", key_cache_to_package)
    app.connect("config-inited", prefill_execution_cache, priority=900)  # after the cache key
    app.add_directive("tpattn-figure", TpattnFigure)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
