"""Bugs and diagnosis: the registry of modes, what a run shows, and which bug explains it."""
