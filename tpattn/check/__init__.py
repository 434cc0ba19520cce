"""The check: one training step on both sides, the five measures, tolerances."""
