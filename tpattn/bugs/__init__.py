"""Bugs and diagnosis: the registry of modes, what a run shows, and which bug explains it."""

from . import made_up  # noqa: F401  (the made-up bugs' stages, parallel.wrong.MADE_UP_STAGES)
