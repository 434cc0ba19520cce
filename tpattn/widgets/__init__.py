"""Explorers for notebooks: an :class:`Explorer` (ipywidgets controls, an output area) and its
static twin for the HTML book (:class:`StaticExplorer`); matplotlib loads on first use."""

from tpattn.lazy import lazy_names
from .core import Explorer, StaticExplorer, config_controls, mode_control, seed_control

_EAGER = ["Explorer", "StaticExplorer", "seed_control", "mode_control", "config_controls"]
_FIGURE_MODULES = ("explorers", "kv")

__getattr__, __dir__ = lazy_names(__name__, globals(), _EAGER, _FIGURE_MODULES)
