"""Figures for ranks (see tpattn.viz)."""
from __future__ import annotations

__all__: list[str] = []
