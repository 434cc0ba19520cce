"""Parallel execution: the sharded block written once (``engine``), per rank, with its
collectives passed in (``collectives``), and the backends that hold the ranks."""
