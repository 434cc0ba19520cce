"""tpattn.source: the shown code is the package's real code, in HTML and in plain text."""
import html
import json
import pathlib
import inspect
import re

import pytest

import tpattn
from tpattn.source import show_source


def test_plain_text_is_the_real_source():
    shown = show_source(tpattn.block.params.shard_params)
    assert shown.text == inspect.getsource(tpattn.block.params.shard_params)
    assert repr(shown).startswith("# tpattn/block/params.py · shard_params\n")


def test_html_text_equals_the_source_and_wraps():
    shown = show_source(tpattn.block.layers.rms_norm, tpattn.parallel.tp.tp_forward)
    page = shown._repr_html_()
    blocks = re.findall(r"<pre[^>]*><code>(.*?)</code></pre>", page, flags=re.S)
    assert len(blocks) == 2
    for block, obj in zip(blocks, shown.objects):
        assert html.unescape(re.sub(r"<[^>]+>", "", block)) == inspect.getsource(obj)
    assert "white-space: pre-wrap" in page  # long lines wrap inside the text column


def test_nothing_to_show_is_a_clear_error():
    with pytest.raises(ValueError, match="at least one"):
        show_source()


#: Sphinx/MyST syntax that JupyterLab, VS Code and Colab show as raw text in a markdown cell
#: (the JupyterLab test, tests/book/test_lab.py, looks for the same strings on the rendered page).
RAW_DIRECTIVES = ("```{", ":pyobject:", "{literalinclude}", "{eval-rst}", ":language: python")
CHAPTERS = sorted(pathlib.Path(__file__).resolve().parents[2].glob("book/*.ipynb"))


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_no_markdown_cell_holds_a_directive_that_notebook_frontends_show_raw(chapter):
    """The package's code is shown by ``show_source`` code cells, never by a Sphinx directive
    (issue 9): a directive works in the HTML book only. ``make test-lab`` checks the rendered
    page in a real JupyterLab; this is the check ``make test`` can afford."""
    cells = json.loads(chapter.read_text())["cells"]
    raw = [(i, d) for i, c in enumerate(cells) if c["cell_type"] == "markdown"
           for d in RAW_DIRECTIVES if d in "".join(c["source"])]
    assert CHAPTERS and not raw, f"{chapter.name}: (cell, directive) shown raw: {raw}"
