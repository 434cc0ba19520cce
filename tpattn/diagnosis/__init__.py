"""Diagnosis: what a run shows without a dense model, tier 0 on the per-rank programs, and which
bug of the registry explains it."""
