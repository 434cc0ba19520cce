"""Explorers: controls that change seeds, modes and shapes, and redraw what they teach.

Imported only by notebooks (``from tpattn import widgets``), never by ``import tpattn``. Each
explorer (``rope_explorer()``, ``sharding_explorer()``, …) returns an :class:`Explorer`:
ipywidgets controls and an output area recomputed through the package; displayed, it also
carries as ``text/html`` its static twin (:class:`StaticExplorer`: the same drawing at
precomputed states behind CSS-only radio buttons), which the HTML book shows. ``core`` and
``static`` load with the package, the figure modules (matplotlib) on first use of a name.
"""

from tpattn.lazy import lazy_names
from .core import Explorer, config_controls, mode_control, seed_control
from .static import StaticExplorer

_EAGER = ["Explorer", "StaticExplorer", "seed_control", "mode_control", "config_controls"]
#: The modules of explorers that draw figures, in the order their names are looked up.
_FIGURE_MODULES = ("explorers", "heads", "kv")

__getattr__, __dir__ = lazy_names(__name__, globals(), _EAGER, _FIGURE_MODULES)
