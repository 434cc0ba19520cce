"""``show_source(obj, ...)``: the package's real source as a notebook cell's output (HTML)."""
from __future__ import annotations

import html
import inspect
from pathlib import Path

__all__ = ["show_source", "Source"]

_ROOT = Path(__file__).resolve().parents[1]

#: Wrapping keeps code inside the text column of the HTML book and of narrow notebook views.
_PRE_STYLE = ("white-space: pre-wrap; overflow-wrap: anywhere; margin: 0; padding: 0.6em 0.8em; "
              "line-height: 1.35; font-size: 0.88em; background: #f8f8f8; color: #1f2328")
_BOX_STYLE = "border: 1px solid #d0d7de; border-radius: 4px; margin: 0.2em 0; overflow: hidden"
_CAPTION_STYLE = ("font-family: monospace; font-size: 0.8em; color: #57606a; background: #eef1f4; "
                  "padding: 0.2em 0.8em; border-bottom: 1px solid #d0d7de")


def _location(obj) -> str:
    """``tpattn/block/params.py · shard_params`` for an object of this package."""
    path = Path(inspect.getsourcefile(obj)).resolve()
    if path.is_relative_to(_ROOT):
        path = path.relative_to(_ROOT)
    return f"{path.as_posix()} · {getattr(obj, '__qualname__', getattr(obj, '__name__', ''))}"


class Source:
    """The source of functions, classes or modules for a notebook (``text``: plain)."""

    def __init__(self, objects):
        if not objects:
            raise ValueError("show_source needs at least one function, class or module")
        self.objects = tuple(objects)
        self.parts = [(_location(o), inspect.getsource(o)) for o in self.objects]
        self.text = "\n".join(src for _, src in self.parts)

    def __repr__(self) -> str:  # text/plain: what a terminal or a plain-text frontend shows
        return "\n".join(f"# {where}\n{src}" for where, src in self.parts).rstrip("\n")

    def _repr_html_(self) -> str:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        formatter = HtmlFormatter(noclasses=True, nowrap=True, style="default")
        boxes = []
        for where, src in self.parts:
            code = highlight(src, PythonLexer(), formatter)
            boxes.append(
                f'<div class="tpattn-source" style="{_BOX_STYLE}">'
                f'<div style="{_CAPTION_STYLE}">{html.escape(where)}</div>'
                f'<pre style="{_PRE_STYLE}"><code>{code}</code></pre></div>')
        return "".join(boxes)


def show_source(*objects) -> Source:
    """The real source of ``objects`` (functions, classes, modules) for a cell's output."""
    return Source(objects)
