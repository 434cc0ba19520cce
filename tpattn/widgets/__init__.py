"""Explorers: controls that change seeds, modes and shapes, and redraw what they teach.

Imported only by notebooks (``from tpattn import widgets``), never by ``import tpattn``.

Each explorer exists twice, from the same package calls:

- **live** — ``rope_explorer()``, ``attention_explorer()``, ``sharding_explorer()``,
  ``seed_mode_explorer()`` return an :class:`Explorer`: ipywidgets controls and an output area
  that recompute through the package in JupyterLab, VS Code or Colab;
- **static** — ``static_*_explorer()`` precompute every state that matters and return a
  :class:`StaticExplorer`: one self-contained HTML block whose CSS-only radio buttons switch
  between the states — no kernel, no JavaScript, no network.

Displaying a live explorer (last expression of a cell) emits one output carrying both:
``application/vnd.jupyter.widget-view+json`` (the live widget, preferred by Jupyter frontends)
and ``text/html`` (the static twin). The book's myst-nb config removes the widget view from
the HTML builder's mime priority (``nb_mime_priority_overrides``), so the rendered page shows
the static explorer: a reader never meets a control that does nothing.

``core`` and ``static`` load with the package; the modules of explorers that draw figures
(``explorers``, ``sp``, ``kv``: matplotlib) on the first use of one of their names, so an
explorer that shows only HTML (``tpattn.widgets.bug_hunt``) does not load matplotlib.
"""

import importlib
import importlib.util

from .core import Explorer, config_controls, mode_control, seed_control
from .static import StaticExplorer

_EAGER = ["Explorer", "StaticExplorer", "seed_control", "mode_control", "config_controls"]
#: The modules of explorers that draw figures, in the order their names are looked up.
FIGURE_MODULES = ("explorers", "sp", "kv")


def _figure_names() -> dict[str, str]:
    """Every public name of the figure modules → its module (imports them: matplotlib)."""
    names: dict[str, str] = {}
    for module in FIGURE_MODULES:
        for name in importlib.import_module(f".{module}", __name__).__all__:
            names.setdefault(name, module)
    return names


def __getattr__(name: str):
    if name == "__all__":
        value = [*_EAGER, *_figure_names()]
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)  # a submodule: viz.sharding
    else:
        module = _figure_names().get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # found once, then an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EAGER, *_figure_names()})
