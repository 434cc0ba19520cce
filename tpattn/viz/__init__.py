"""Figures for the book (matplotlib). Imported only by notebooks — never by ``import tpattn``.

``style`` (the shared style), then one module of figures per part of the book; ``frames``
draws the heads pictures (matplotlib and SVG), ``tables`` the five measures as text.
``tables`` loads with the package, the figure modules (and matplotlib) on the first use of
one of their names.
"""
from tpattn.lazy import lazy_names
from .tables import *  # noqa: F401,F403
from .tables import __all__ as _tables

#: The modules of figures, in the order their names are looked up.
_FIGURE_MODULES = ("style", "overview", "layers", "heads", "sharding", "ranks", "sp", "kv", "flow")

__getattr__, __dir__ = lazy_names(__name__, globals(), _tables, _FIGURE_MODULES)
