"""Parallel execution: the sharded block written once (``engine``), its collectives, backends."""
