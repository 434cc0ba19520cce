"""Figures for sharding (see tpattn.viz)."""
from __future__ import annotations

__all__: list[str] = []
