"""Static explorers: precomputed panels behind radio buttons that select one through CSS alone
(no JavaScript). Where ``<style>`` is stripped, every panel shows, captioned."""
from __future__ import annotations

import hashlib
import html
import itertools
import re
from typing import Mapping, Sequence

__all__ = ["StaticExplorer"]

_CSS = """
#{p} {{ border: 1px solid var(--pst-color-border, #d0d7de); border-radius: 6px;
        padding: 0.6em 0.8em; margin: 0.5em 0 1em 0; }}
#{p} > input {{ position: absolute; opacity: 0; width: 0; height: 0; margin: 0; }}
#{p} .tpx-controls {{ display: flex !important; flex-wrap: wrap; gap: 0.3em 1.2em;
                      margin-bottom: 0.5em; }}
#{p} .tpx-group {{ display: flex; flex-wrap: wrap; align-items: center; gap: 0.25em; }}
#{p} .tpx-name {{ font-weight: 600; margin-right: 0.2em; }}
#{p} .tpx-controls label {{ cursor: pointer; padding: 0.1em 0.55em; margin: 0;
                            border: 1px solid var(--pst-color-border, #d0d7de);
                            border-radius: 4px; font-size: 0.9em; user-select: none; }}
#{p} .tpx-controls label:hover {{ border-color: var(--pst-color-primary, #0969da); }}
#{p} .tpx-panel {{ display: none; }}
#{p} .tpx-caption {{ display: none; }}
#{p} .tpx-panel img {{ max-width: 100%; height: auto; }}
#{p} .tpx-note {{ font-size: 0.8em; opacity: 0.75; margin: 0.3em 0 0 0; }}
"""
_SELECTED = ("background: var(--pst-color-primary, #0969da); color: #fff; "
             "border-color: var(--pst-color-primary, #0969da);")
_FOCUSED = "outline: 2px solid var(--pst-color-primary, #0969da); outline-offset: 1px;"
_HIDDEN = "position:absolute;opacity:0;width:0;height:0;margin:0"
_DATA_URI = re.compile(r"data:image/png;base64,[A-Za-z0-9+/=]+")


class StaticExplorer:
    """``panels`` ``{(i0, i1, …): html}`` for every combination of the options of ``groups``
    ``[(name, [label, …]), …]``, ``initial`` selected; ids hash the text, not the PNGs."""

    def __init__(self, kind: str, groups: Sequence[tuple[str, Sequence[str]]],
                 panels: Mapping[tuple[int, ...], str], initial: tuple[int, ...] | None = None,
                 note: str | None = None):
        self.kind = kind
        self.groups = [(name, list(options)) for name, options in groups]
        combos = list(itertools.product(*(range(len(o)) for _, o in self.groups)))
        missing = [c for c in combos if c not in panels]
        if missing:
            raise ValueError(f"panels must cover every combination of options (missing {missing[:3]})")
        self.panels = {c: panels[c] for c in combos}
        self.initial = tuple(initial) if initial is not None else combos[0]
        if self.initial not in self.panels:
            raise ValueError(f"initial must be a combination of option indices (got {initial!r})")
        self.note = ("Precomputed when the book was built. Run the notebook to explore any "
                     "value.") if note is None else note
        text = [_DATA_URI.sub("", body) for body in self.panels.values()]
        digest = hashlib.sha1(repr((kind, self.groups, text)).encode()).hexdigest()[:10]
        self.prefix = f"tpx-{kind}-{digest}"
        self.html = self._render()

    def __len__(self) -> int:
        return len(self.panels)

    def _repr_html_(self) -> str:
        return self.html

    def _render(self) -> str:
        p = self.prefix
        radio = lambda g, i: f"{p}-g{g}-{i}"  # noqa: E731
        panel = lambda combo: f"{p}-p" + "-".join(map(str, combo))  # noqa: E731
        rules = [_CSS.format(p=p)]
        for combo in self.panels:
            chain = " ~ ".join(f"#{radio(g, i)}:checked" for g, i in enumerate(combo))
            rules.append(f"{chain} ~ .tpx-panels > #{panel(combo)} {{ display: block; }}")
        for g, (_, options) in enumerate(self.groups):
            for i in range(len(options)):
                rules.append(f"#{radio(g, i)}:checked ~ .tpx-controls label[for={radio(g, i)}] "
                             f"{{ {_SELECTED} }}")
                rules.append(f"#{radio(g, i)}:focus-visible ~ .tpx-controls "
                             f"label[for={radio(g, i)}] {{ {_FOCUSED} }}")
        out = [f'<div class="tpx" id="{p}" data-tpx-kind="{html.escape(self.kind)}">',
               "<style>", *rules, "</style>"]
        for g, (name, options) in enumerate(self.groups):
            for i in range(len(options)):
                checked = " checked" if self.initial[g] == i else ""
                out.append(f'<input type="radio" name="{p}-g{g}" id="{radio(g, i)}" '
                           f'style="{_HIDDEN}"{checked}>')
        out.append('<div class="tpx-controls" style="display:none">')
        for g, (name, options) in enumerate(self.groups):
            out.append(f'<div class="tpx-group" role="radiogroup" '
                       f'aria-label="{html.escape(name)}">'
                       f'<span class="tpx-name">{html.escape(name)}</span>')
            out.extend(f'<label for="{radio(g, i)}">{html.escape(option)}</label>'
                       for i, option in enumerate(options))
            out.append("</div>")
        out.append("</div>")
        out.append('<div class="tpx-panels">')
        for combo, body in self.panels.items():
            caption = " · ".join(f"{name} {options[i]}"
                                 for (name, options), i in zip(self.groups, combo))
            out.append(f'<div class="tpx-panel" id="{panel(combo)}" '
                       f'data-state="{html.escape(caption)}">'
                       f'<p class="tpx-caption"><strong>{html.escape(caption)}</strong></p>'
                       f"{body}</div>")
        out.append("</div>")
        if self.note:
            out.append(f'<p class="tpx-note">{html.escape(self.note)}</p>')
        out.append("</div>")
        return "\n".join(out)
