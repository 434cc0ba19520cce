#!/usr/bin/env python3
"""Strip from the book's notebooks what neither the book build nor nbval uses; make the Colab
setup cell follow ``_config.yml``.

What goes, and why it is safe:

- ``metadata.widgets`` — the saved ipywidgets state (45–90 KB a notebook). The HTML book loads
  no widget JavaScript (``nb_ipywidgets_js: {}`` in ``_config.yml``), nbval never compares
  metadata, and a live notebook rebuilds every widget when its cell runs.
- ``application/vnd.jupyter.widget-view+json`` in an output that also carries ``text/html`` —
  a ``tpattn.widgets`` explorer is one output with the live view and its precomputed static
  twin (``Explorer._repr_mimebundle_``). The HTML builders give the view no priority
  (``nb_mime_priority_overrides``), so the page shows the twin; without saved widget state the
  view could not render anyway, and a frontend that finds no view shows the twin too. An output
  with a widget view and no ``text/html`` is kept as it is.

- the kernel's chunking of a cell's prints — consecutive ``stream`` outputs of one name
  (stdout, stderr) are joined into one. How many chunks a run produces depends on timing, so a
  re-run would otherwise rewrite outputs whose text did not change. nbval joins them before
  comparing and the book joins them too (``nb_merge_streams``): the text read is the same.

What stays: outputs (their text), execution counts (nbval and readers use them), ``kernelspec`` and
``language_info``.

The setup cell (the first code cell of every chapter, which installs the package in Colab)
is plumbing: it gets the tag ``remove-cell`` (hidden in the HTML, still run by Jupyter and
nbval), and its ``git+`` URL is rewritten from ``repository.url`` in ``_config.yml`` — the one
place a publisher edits.

Usage::

    python tools/clean_notebooks.py                 # every notebook under book/
    python tools/clean_notebooks.py book/08_*.ipynb # some
    python tools/clean_notebooks.py --check         # exit 1 and list what would change
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
CONFIG = ROOT / "_config.yml"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
SETUP_TAG = "remove-cell"
#: The setup cell, with ``{url}`` for the repository URL.
SETUP_TEMPLATE = (
    "# Setup. In Colab, install tpattn first; elsewhere the repository's `make lab` has done it.\n"
    "import sys\n"
    'if "google.colab" in sys.modules:\n'
    '    %pip install --quiet "tpattn[book] @ git+{url}"')
_SETUP_PATTERN = re.compile(re.escape(SETUP_TEMPLATE).replace(re.escape("{url}"), r"(\S+?)"))


def repository_url(config: pathlib.Path = CONFIG) -> str:
    """``repository.url`` of ``_config.yml`` (read with a tiny parser: no PyYAML needed)."""
    section = None
    for line in config.read_text().splitlines():
        if re.match(r"^\S", line):
            section = line.split(":", 1)[0].strip()
        elif section == "repository":
            m = re.match(r"^\s+url:\s*(\S+)", line)
            if m:
                return m.group(1).strip("\"'")
    raise ValueError(f"{config}: no repository.url")


def setup_cell_source(url: str) -> str:
    """The setup cell's source for the repository at ``url``."""
    return SETUP_TEMPLATE.format(url=url)


def setup_cell_url(source: str) -> str | None:
    """The URL a setup cell installs from, or None if ``source`` is not the setup cell."""
    m = _SETUP_PATTERN.fullmatch(source.strip())
    return m.group(1) if m else None


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _text(output: dict) -> str:
    text = output.get("text", "")
    return "".join(text) if isinstance(text, list) else text


def clean(nb: dict, url: str) -> list[str]:
    """Clean ``nb`` in place; returns what changed, one line per kind (empty: nothing)."""
    changes = []
    if "widgets" in nb.get("metadata", {}):
        del nb["metadata"]["widgets"]
        changes.append("dropped metadata.widgets")
    views = 0
    for cell in nb.get("cells", []):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW in data and "text/html" in data:
                del data[WIDGET_VIEW]
                views += 1
    if views:
        changes.append(f"dropped {views} widget view(s) that have a static twin")
    joined = 0
    for cell in nb.get("cells", []):
        merged = []
        for output in cell.get("outputs", []):
            last = merged[-1] if merged else None
            if (output.get("output_type") == "stream" and last is not None
                    and last.get("output_type") == "stream" and last.get("name") == output.get("name")):
                last["text"] = _text(last) + _text(output)
                joined += 1
            else:
                merged.append(output)
        if "outputs" in cell:
            cell["outputs"] = merged
    if joined:
        changes.append(f"joined {joined} stream chunk(s) into the output before")
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    if code and setup_cell_url(_source(code[0])) is not None:
        first = code[0]
        if setup_cell_url(_source(first)) != url:
            first["source"] = setup_cell_source(url)
            changes.append(f"setup cell installs from {url}")
        tags = first.setdefault("metadata", {}).setdefault("tags", [])
        if SETUP_TAG not in tags:
            tags.append(SETUP_TAG)
            changes.append(f"setup cell tagged {SETUP_TAG}")
    return changes


def dumps(nb: dict) -> str:
    """The notebook as Jupyter writes it (nbformat's layout: indent 1, sorted keys)."""
    try:
        import nbformat
    except ImportError:  # the same layout by hand
        return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    text = nbformat.writes(nbformat.from_dict(nb), version=4)
    return text if text.endswith("\n") else text + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=pathlib.Path,
                    help="notebooks to clean (default: every .ipynb under book/)")
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a notebook would change")
    args = ap.parse_args(argv)
    paths = args.notebooks or sorted(p for p in BOOK.rglob("*.ipynb")
                                     if ".ipynb_checkpoints" not in p.parts)
    url = repository_url()
    dirty = 0
    for path in paths:
        nb = json.loads(path.read_text())
        changes = clean(nb, url)
        if not changes:
            continue
        dirty += 1
        print(f"{path}: {'; '.join(changes)}")
        if not args.check:
            path.write_text(dumps(nb))
    return 1 if args.check and dirty else 0


if __name__ == "__main__":
    sys.exit(main())
