"""Figures for the book (matplotlib). Imported only by notebooks — never by ``import tpattn``.

One shared style (``style``), then one module of figures per part of the book:
``overview`` (landing page, chapter 1), ``layers`` (chapters 2–5), ``sharding`` (chapters 6–10), ``ranks`` (chapter 11),
``sp`` (chapter 12), ``kv`` (chapter 13).
"""
from .style import *  # noqa: F401,F403
from .overview import *  # noqa: F401,F403
from .layers import *  # noqa: F401,F403
from .sharding import *  # noqa: F401,F403
from .ranks import *  # noqa: F401,F403
from .sp import *  # noqa: F401,F403
from .kv import *  # noqa: F401,F403
