"""Fast checks of the book's configuration (seconds; the build itself is `make book`).

What each test guards is a way the book has broken, or silently would:
- `_config.yml` keeps the execution settings that make `make book` re-run every notebook and fail
  on an error, and the settings that keep the HTML offline (MathJax served locally, no widget JS);
- `_toc.yml` and `book/` agree (a chapter missing from either side);
- every chapter starts with the same setup cell (Colab installs the package with it);
- the built HTML (when `make book` has produced it) loads nothing from a CDN.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
HTML = ROOT / "_build" / "html"

SETUP_CELL = '''# Setup. In Colab, install tpattn first; elsewhere the repository's `make lab` has done it.
import sys
if "google.colab" in sys.modules:
    %pip install --quiet "tpattn[book] @ git+https://github.com/tpattn/tpattn"'''


def load_yaml(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


@pytest.fixture(scope="module")
def config() -> dict:
    return load_yaml("_config.yml")


def toc_files() -> list[str]:
    """Every file named in _toc.yml (root first), without extension."""
    toc = load_yaml("_toc.yml")
    return [toc["root"]] + [ch["file"] for part in toc["parts"] for ch in part["chapters"]]


def book_pages() -> list[pathlib.Path]:
    """Every .md / .ipynb page under book/ (not the extension or static folders)."""
    return sorted(p for p in BOOK.rglob("*") if p.suffix in (".md", ".ipynb")
                  and not {"_ext", "_static", ".ipynb_checkpoints"} & set(p.relative_to(BOOK).parts))


def test_execution_settings(config):
    execute = config["execute"]
    # `auto` would skip our notebooks: they are committed with outputs (for nbval).
    assert execute["execute_notebooks"] == "cache"
    assert execute["timeout"] >= 60
    sphinx = config["sphinx"]["config"]
    assert sphinx["nb_execution_raise_on_error"] is True


def test_offline_assets(config):
    sphinx = config["sphinx"]["config"]
    assert sphinx["nb_ipywidgets_js"] == {}, "myst-nb would load require.js/html-manager from a CDN"
    # Sphinx serves a relative mathjax_path from _static/, where html_static_path's contents
    # land; the Makefile's MathJax rule fetches exactly that file into vendor/.
    mathjax = pathlib.PurePosixPath(sphinx["mathjax_path"])
    makefile = (ROOT / "Makefile").read_text()
    make_vars = dict(re.findall(r"^(\w+) := (\S+)", makefile, re.MULTILINE))
    vendored = make_vars["MATHJAX"].replace("$(VENDOR)", make_vars["VENDOR"])
    assert vendored in {str(static / mathjax) for static in map(pathlib.PurePosixPath,
                                                                   sphinx["html_static_path"])}
    # Jupyter Book adds every *.js under the static paths to every page once a root-level
    # _static/ exists: the vendored MathJax (dozens of modules) would load on every page.
    assert not (ROOT / "_static").exists()
    assert not list(BOOK.glob("_static/**/*.js"))


def test_everything_but_the_book_is_excluded(config):
    excluded = set(config["exclude_patterns"])
    assert {".venv", "vendor", "tests", "bench", "tpattn", "README.md", "_build",
            "**.ipynb_checkpoints"} <= excluded


def test_launch_and_repository_buttons(config):
    assert config["launch_buttons"]["binderhub_url"] and config["launch_buttons"]["colab_url"]
    assert config["repository"]["url"] == "https://github.com/tpattn/tpattn"
    assert config["html"]["use_repository_button"] and config["html"]["use_issues_button"]


def test_toc_lists_exactly_the_pages_in_book():
    listed = toc_files()
    assert len(listed) == len(set(listed)), "a page is listed twice"
    on_disk = {p.relative_to(ROOT).with_suffix("").as_posix() for p in book_pages()}
    assert sorted(set(listed) - on_disk) == [], "listed in _toc.yml but missing from book/"
    assert sorted(on_disk - set(listed)) == [], "in book/ but not in _toc.yml"


def test_chapters_start_with_the_setup_cell():
    for page in book_pages():
        if page.suffix != ".ipynb":
            continue
        nb = json.loads(page.read_text())
        first_code = next(c for c in nb["cells"] if c["cell_type"] == "code")
        assert "".join(first_code["source"]).strip() == SETUP_CELL, page.name
        assert nb["metadata"]["kernelspec"]["name"] == "python3", page.name


def test_local_extension_keys_the_cache_on_the_package():
    spec = importlib.util.spec_from_file_location("tpattn_book", BOOK / "_ext" / "tpattn_book.py")
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    digest = ext.package_digest()
    assert re.fullmatch(r"[0-9a-f]{16}", digest) and digest == ext.package_digest()


#: Hosts that serve JavaScript/CSS/fonts to web pages; the offline book must name none of them.
CDN_HOST = re.compile(r"(^|\.)(unpkg\.com|jsdelivr\.net|cdnjs\.cloudflare\.com|googleapis\.com"
                      r"|gstatic\.com|cdn\.[\w.-]+)$", re.IGNORECASE)


@pytest.mark.skipif(not (HTML / "book" / "intro.html").exists(),
                    reason="no built book (run `make book`; `make test` does)")
def test_built_html_loads_nothing_from_the_internet():
    for page in sorted(HTML.rglob("*.html")):
        html = page.read_text(errors="replace")
        # What a browser fetches on its own: scripts, stylesheets, images, frames.
        for ref in re.findall(r"<(?:script|link|img|iframe|source)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"",
                              html):
            assert ref.startswith("data:") or ("://" not in ref and not ref.startswith("//")), \
                f"{page.relative_to(HTML)} loads {ref}"
        # Links may point anywhere (launch buttons, citations) but never at a CDN, which would
        # mean some script builds a URL to load from it.
        for host in re.findall(r"https?://([^/\"'\s<>)]+)", html):
            assert not CDN_HOST.search(host), f"{page.relative_to(HTML)} names {host}"
    assert (HTML / "_static" / "mathjax" / "tex-chtml.js").is_file()


def test_block_map_is_drawn_from_the_package():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    import tpattn
    from tpattn.viz.overview import block_map_figure, rank_heads

    cfg = tpattn.Config(query_heads=8, kv_heads=4, world_size=4)
    fig = block_map_figure(cfg)
    texts = "\n".join(t.get_text() for t in fig.axes[0].texts)
    plt.close(fig)
    for rank in range(cfg.world_size):
        q_heads, kv_heads = rank_heads(cfg, rank)
        assert f"rank {rank}" in texts
        assert f"q heads {q_heads.start}–{q_heads.stop - 1}" in texts
    assert [list(rank_heads(cfg, r)[1]) for r in range(4)] == [[0], [1], [2], [3]]
    assert "copy_to_ranks" in texts and "reduce_output" in texts
    # f's backward all-reduces dn (the gradient at n, after RMSNorm), never dX
    assert "bwd: all-reduce dn" in texts and "all-reduce dX" not in texts
