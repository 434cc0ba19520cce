"""tpattn.source: the shown code is the package's real code, in HTML and in plain text."""
import html
import inspect
import re

import pytest

import tpattn
from tpattn.source import show_source


def test_plain_text_is_the_real_source():
    shown = show_source(tpattn.params.shard_params)
    assert shown.text == inspect.getsource(tpattn.params.shard_params)
    assert repr(shown).startswith("# tpattn/params.py · shard_params\n")


def test_html_text_equals_the_source_and_wraps():
    shown = show_source(tpattn.layers.rms_norm, tpattn.tp.tp_forward)
    page = shown._repr_html_()
    blocks = re.findall(r"<pre[^>]*><code>(.*?)</code></pre>", page, flags=re.S)
    assert len(blocks) == 2
    for block, obj in zip(blocks, shown.objects):
        assert html.unescape(re.sub(r"<[^>]+>", "", block)) == inspect.getsource(obj)
    assert "white-space: pre-wrap" in page  # long lines wrap inside the text column


def test_nothing_to_show_is_a_clear_error():
    with pytest.raises(ValueError, match="at least one"):
        show_source()
