"""Figures for the book (matplotlib). Imported only by notebooks — never by ``import tpattn``.

One shared style (``style``), then one module of figures per part of the book:
``overview`` (landing page, chapter 1), ``layers`` (chapters 2–5), ``sharding`` (chapters 6–10),
``ranks`` (chapter 11), ``sp`` (chapter 12), ``kv`` (chapter 13); ``frames``, the heads pictures
(matplotlib figures and SVG) of the sharding and kv figures; and ``tables``, the five
measures as text.

``tables`` is loaded with the package; the figure modules (and with them matplotlib) on the
first use of one of their names (``viz.heads_to_ranks_figure``): a chapter that only prints
``viz.format_measure`` does not pay for matplotlib.
"""
from ..lazy import lazy_names
from .tables import *  # noqa: F401,F403
from .tables import __all__ as _tables

#: The modules of figures, in the order their names are looked up.
FIGURE_MODULES = ("style", "overview", "layers", "sharding", "ranks", "sp", "kv", "flow")

__getattr__, __dir__ = lazy_names(__name__, globals(), _tables, FIGURE_MODULES)
