"""Real ranks: torch.distributed processes, DTensor cross-checks, any module's TP plan."""
