"""Sphinx glue for the tpattn book (loaded from ``_config.yml`` → ``sphinx.local_extensions``).

Two things the stock Jupyter Book does not do:

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

It also fails the build early, with the fix, when ``make setup`` has not fetched MathJax yet.
"""
from __future__ import annotations

import base64
import hashlib
import importlib
import io
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.errors import ConfigError
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tpattn"


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
    app.add_directive("tpattn-figure", TpattnFigure)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
