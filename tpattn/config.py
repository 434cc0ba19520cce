"""The block's shape: one frozen, validated ``Config``.

Every other module takes a ``Config`` and trusts it, so every rule a shape must obey is checked
here, at construction time, with a ``ValueError`` that names the field and the rule. A bad shape
never reaches torch as a cryptic ``view`` error.

Tensor layout used throughout the package (Megatron's sequence-first layout)::

    x            [S, B, hidden]                S = seq, B = batch
    q            [S, B, query_heads, head_dim]
    k, v         [S, B, kv_heads, head_dim]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

#: dtypes a Config may ask for, by name.
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

_POSITIVE_INTS = ("seq", "batch", "hidden", "query_heads", "kv_heads", "head_dim", "world_size")


@dataclass(frozen=True)
class Config:
    """Shape of one attention block and how it is split across tensor-parallel ranks.

    Defaults are the seed fixture's: 5 tokens, batch 2, hidden 16, 4 query heads sharing
    2 KV heads (GQA, 2 query heads per KV head), head_dim 4, 2 TP ranks.

    Rules (checked on construction, ``ValueError`` otherwise):

    - ``seq, batch, hidden, query_heads, kv_heads, head_dim, world_size`` are integers ≥ 1;
    - ``eps`` is a finite number > 0;
    - ``head_dim`` is even (RoPE rotates pairs of channels);
    - ``query_heads % kv_heads == 0`` (each KV head serves a whole group of query heads);
    - ``kv_heads % world_size == 0`` (every rank holds complete query/KV groups; replicating
      KV heads when ``kv_heads < world_size`` is not supported yet);
    - ``dtype`` is ``"float32"``, ``"float64"`` or ``"bfloat16"`` (a ``torch.dtype`` is accepted and
      stored by name; bfloat16 keeps parameters and activations in bf16).
    """

    seq: int = 5
    batch: int = 2
    hidden: int = 16
    query_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 4
    world_size: int = 2
    eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self) -> None:
        problems = []
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                problems.append(f"{name} must be an integer >= 1 (got {value!r})")
            elif value < 1:
                problems.append(f"{name} must be an integer >= 1 (got {value})")
        if problems:  # the divisibility rules below need valid integers
            raise ValueError("invalid Config: " + "; ".join(problems))

        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
            problems.append(f"eps must be a finite number > 0 (got {eps!r})")
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for RoPE's channel pairs (got {self.head_dim})")
        if self.query_heads % self.kv_heads:
            problems.append(
                f"query_heads must be a multiple of kv_heads "
                f"(got query_heads={self.query_heads}, kv_heads={self.kv_heads})")
        if self.kv_heads % self.world_size:
            problems.append(
                f"kv_heads must be a multiple of world_size so each rank holds complete "
                f"query/KV groups (got kv_heads={self.kv_heads}, world_size={self.world_size}); "
                f"replicating KV heads when kv_heads < world_size is not supported yet")
        dtype = self.dtype
        if isinstance(dtype, torch.dtype):
            names = {v: k for k, v in DTYPES.items()}
            if dtype in names:
                object.__setattr__(self, "dtype", names[dtype])
            else:
                problems.append(f"dtype must be one of {sorted(DTYPES)} (got {dtype})")
        elif dtype not in DTYPES:
            problems.append(f"dtype must be one of {sorted(DTYPES)} (got {dtype!r})")
        if problems:
            raise ValueError("invalid Config: " + "; ".join(problems))

    # --- derived quantities: named once here so no module re-derives them -----------------

    @property
    def torch_dtype(self) -> torch.dtype:
        """The ``torch.dtype`` named by ``dtype``."""
        return DTYPES[self.dtype]

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.query_heads // self.kv_heads

    @property
    def local_query_heads(self) -> int:
        """Query heads held by one TP rank."""
        return self.query_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        """KV heads held by one TP rank."""
        return self.kv_heads // self.world_size

    def as_dict(self) -> dict:
        """All fields, in declaration order (``dtype`` by name)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
