"""Figures for the book (matplotlib). Imported only by notebooks — never by ``import tpattn``.

One shared style (``style``), then one module of figures per part of the book:
``overview`` (landing page, chapter 1), ``layers`` (chapters 2–5), ``sharding`` (chapters 6–10),
``ranks`` (chapter 11), ``sp`` (chapter 12), ``kv`` (chapter 13); and ``tables``, the five
measures as text.

``tables`` is loaded with the package; the figure modules (and with them matplotlib) on the
first use of one of their names (``viz.heads_to_ranks_figure``): a chapter that only prints
``viz.format_measure`` does not pay for matplotlib.
"""
import importlib
import importlib.util

from .tables import *  # noqa: F401,F403
from .tables import __all__ as _tables

#: The modules of figures, in the order their names are looked up.
FIGURE_MODULES = ("style", "overview", "layers", "sharding", "ranks", "sp", "kv")


def _figure_names() -> dict[str, str]:
    """Every public name of the figure modules → its module (imports them: matplotlib)."""
    names: dict[str, str] = {}
    for module in FIGURE_MODULES:
        for name in importlib.import_module(f".{module}", __name__).__all__:
            names.setdefault(name, module)
    return names


def __getattr__(name: str):
    if name == "__all__":
        value = [*_tables, *_figure_names()]
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
    return sorted({*globals(), *_tables, *_figure_names()})
