"""Figures for the book (matplotlib), for notebooks only: ``tables`` (the five measures as
text) loads with the package, the figure modules (and matplotlib) on first use of a name."""
from tpattn.lazy import lazy_names
from .tables import *  # noqa: F401,F403
from .tables import __all__ as _tables

_FIGURE_MODULES = ("style", "overview", "layers", "heads", "sharding", "sp_layout", "kv")

__getattr__, __dir__ = lazy_names(__name__, globals(), _tables, _FIGURE_MODULES)
