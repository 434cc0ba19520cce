"""Figures for the landing page and chapter 1 (see tpattn.viz)."""
from __future__ import annotations

__all__: list[str] = []
