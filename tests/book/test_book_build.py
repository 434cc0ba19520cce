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

ROOT = pathlib.Path(__file__).resolve().parents[2]
BOOK = ROOT / "book"
HTML = ROOT / "_build" / "html"

#: The repository URL lives in _config.yml only (tools/clean_notebooks.py writes it into the cells).
SETUP_CELL = '''# Setup. In Colab, install tpattn first; elsewhere the repository's `make lab` has done it.
import sys
if "google.colab" in sys.modules:
    %pip install --quiet "tpattn[book] @ git+{url}"'''.format(
    url=yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"])


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


@pytest.mark.built_book
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


def load_book_extension():
    spec = importlib.util.spec_from_file_location("tpattn_book", BOOK / "_ext" / "tpattn_book.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_book_jobs_setting_is_checked(monkeypatch):
    ext = load_book_extension()
    monkeypatch.delenv("TPATTN_BOOK_JOBS", raising=False)
    assert 1 <= ext.execution_jobs() <= 8
    monkeypatch.setenv("TPATTN_BOOK_JOBS", "3")
    assert ext.execution_jobs() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("TPATTN_BOOK_JOBS", bad)
        with pytest.raises(Exception, match="TPATTN_BOOK_JOBS must be a positive integer"):
            ext.execution_jobs()


def test_parallel_prefill_caches_what_myst_nb_then_finds(tmp_path, monkeypatch):
    """Two notebooks executed by the pre-fill: the one that runs is in the cache under the key
    myst-nb matches; the one that raises is not cached (myst-nb re-runs it and reports it)."""
    import types

    import nbformat
    from jupyter_cache import get_cache

    ext = load_book_extension()
    src = tmp_path / "src"
    (src / "book").mkdir(parents=True)
    good = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os\nprint(os.path.basename(os.getcwd()))")])
    bad = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")])
    for nb in (good, bad):
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
    nbformat.write(good, src / "book" / "good.ipynb")
    nbformat.write(bad, src / "book" / "bad.ipynb")
    (src / "_build").mkdir()
    nbformat.write(good, src / "_build" / "excluded.ipynb")  # exclude_patterns: not a page
    config = types.SimpleNamespace(
        nb_execution_mode="cache", nb_execution_cache_path=str(tmp_path / "cache"),
        nb_execution_timeout=60, nb_execution_allow_errors=False, exclude_patterns=["_build"])
    app = types.SimpleNamespace(srcdir=str(src), outdir=str(src / "_build" / "html"),
                                config=config)
    assert [p.name for p in ext.book_notebooks(app)] == ["bad.ipynb", "good.ipynb"]
    monkeypatch.setenv("TPATTN_BOOK_JOBS", "2")
    ext.prefill_execution_cache(app, config)
    cache = get_cache(config.nb_execution_cache_path)
    record = cache.match_cache_notebook(nbformat.read(src / "book" / "good.ipynb", as_version=4))
    executed = cache.get_cache_bundle(record.pk).nb
    assert executed.cells[0].outputs[0]["text"] == "book\n"  # ran in the notebook's folder
    with pytest.raises(KeyError):
        cache.match_cache_notebook(nbformat.read(src / "book" / "bad.ipynb", as_version=4))
