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

from ..lazy import lazy_names
from .core import Explorer, config_controls, mode_control, seed_control
from .static import StaticExplorer

_EAGER = ["Explorer", "StaticExplorer", "seed_control", "mode_control", "config_controls"]
#: The modules of explorers that draw figures, in the order their names are looked up.
FIGURE_MODULES = ("explorers", "sp", "kv")

__getattr__, __dir__ = lazy_names(__name__, globals(), _EAGER, FIGURE_MODULES)
