"""The dense block: RMSNorm, RoPE, grouped-query causal attention, the output projection and its parameters."""
