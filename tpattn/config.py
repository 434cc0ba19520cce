"""The block's shape: one frozen ``Config``, every rule checked on construction. Layout
(Megatron's sequence-first): x ``[S, B, hidden]``, q ``[S, B, query_heads, head_dim]``."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

#: dtypes a Config may ask for, by name.
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

_POSITIVE_INTS = ("seq", "batch", "hidden", "query_heads", "kv_heads", "head_dim", "world_size")


@dataclass(frozen=True)
class Config:
    """Shape of one attention block and how it is split across tensor-parallel ranks (defaults:
    the original fixture's); a broken rule raises ``ValueError`` naming it. Around the block,
    off by default: ``data_parallel`` (a TP × DP mesh of ``world_size * data_parallel`` ranks),
    ``dropout`` in ``[0, 1)`` and ``qk_norm`` (both need plain TP)."""

    seq: int = 5
    batch: int = 2
    hidden: int = 16
    query_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 4
    world_size: int = 2
    eps: float = 1e-6
    dtype: str = "float32"
    #: ``omit_default``: left out of ``repr`` at its default (the original fixture's repr).
    sequence_parallel: bool = field(default=False, metadata={"omit_default": True})
    kv_strategy: str = field(default="replicate_weights", metadata={"omit_default": True})
    data_parallel: int = field(default=1, metadata={"omit_default": True})
    dropout: float = field(default=0.0, metadata={"omit_default": True})
    qk_norm: bool = field(default=False, metadata={"omit_default": True})

    def __repr__(self) -> str:
        """The dataclass repr without the ``omit_default`` fields at their default."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if not (f.metadata.get("omit_default") and getattr(self, f.name) == f.default)]
        return f"Config({', '.join(shown)})"

    def __post_init__(self) -> None:
        problems = []
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be an integer >= 1 (got {value!r})")
        if problems:  # the divisibility rules below need valid integers
            raise ValueError("invalid Config: " + "; ".join(problems))

        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
            problems.append(f"eps must be a finite number > 0 (got {eps!r})")
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for RoPE's channel pairs (got {self.head_dim})")
        if self.query_heads % self.kv_heads:
            problems.append(f"query_heads must be a multiple of kv_heads "
                            f"(got query_heads={self.query_heads}, kv_heads={self.kv_heads})")
        problems += _kv_layout_problems(self)
        if not isinstance(self.sequence_parallel, bool):
            problems.append(f"sequence_parallel must be True or False (got {self.sequence_parallel!r})")
        elif self.sequence_parallel and self.seq % self.world_size:
            problems.append(
                f"seq must be a multiple of world_size under sequence_parallel, so each rank "
                f"holds seq // world_size tokens (got seq={self.seq}, world_size={self.world_size})")
        if self.sequence_parallel is True and self.kv_heads < self.world_size:
            problems.append(
                f"sequence_parallel needs kv_heads >= world_size: sequence parallelism with "
                f"replicated or gathered KV heads is not built (got kv_heads={self.kv_heads}, "
                f"world_size={self.world_size})")
        problems += _surrounding_problems(self)
        dtype = self.dtype
        names = {v: k for k, v in DTYPES.items()}
        if isinstance(dtype, torch.dtype) and dtype in names:
            object.__setattr__(self, "dtype", names[dtype])
        elif dtype not in DTYPES:
            problems.append(f"dtype must be one of {sorted(DTYPES)} (got {dtype!r})")
        if problems:
            raise ValueError("invalid Config: " + "; ".join(problems))

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
        """KV heads one TP rank attends with: ``kv_heads / world_size``, at least 1."""
        return max(1, self.kv_heads // self.world_size)

    @property
    def kv_replicas(self) -> int:
        """Ranks that share one KV head: ``world_size / kv_heads``, at least 1."""
        return max(1, self.world_size // self.kv_heads)

    @property
    def ranks(self) -> int:
        """Ranks of the whole job: ``world_size * data_parallel`` (TP × DP)."""
        return self.world_size * self.data_parallel

    @property
    def model_options(self) -> bool:
        """True when ``dropout > 0`` or ``qk_norm`` (the one-graph view models neither)."""
        return self.dropout > 0 or self.qk_norm

    @property
    def local_seq(self) -> int:
        """Residual-stream tokens per rank: ``seq // world_size`` under SP, else ``seq``."""
        return self.seq // self.world_size if self.sequence_parallel else self.seq

    def as_dict(self) -> dict:
        """All fields, in declaration order (``dtype`` by name)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: How ranks get the KV head they read when ``kv_heads < world_size`` (``Config.kv_strategy``).
KV_STRATEGIES = ("replicate_weights", "gather_activations")


def _kv_layout_problems(cfg: Config) -> list[str]:
    """The KV-head layout rules of ``Config`` that ``cfg`` breaks, one message each."""
    q, kv, w = cfg.query_heads, cfg.kv_heads, cfg.world_size
    problems = []
    if kv >= w and kv % w:
        problems.append(
            f"kv_heads must be a multiple of world_size when kv_heads >= world_size, so each "
            f"rank holds complete query/KV groups (got kv_heads={kv}, world_size={w})")
    if kv < w and w % kv:
        shared = ("its K/V activations gathered to them"
                  if cfg.kv_strategy == "gather_activations"
                  else "its K/V weights replicated on them")
        problems.append(
            f"world_size must be a multiple of kv_heads when kv_heads < world_size, so each KV "
            f"head serves world_size/kv_heads whole ranks ({shared}) "
            f"(got kv_heads={kv}, world_size={w})")
    if kv < w and q % w:
        problems.append(f"query_heads must be a multiple of world_size when kv_heads < "
                        f"world_size (got query_heads={q}, world_size={w})")
    strategy = cfg.kv_strategy
    if strategy not in KV_STRATEGIES:
        problems.append(f"kv_strategy must be one of {', '.join(KV_STRATEGIES)} (got {strategy!r})")
    elif strategy == "gather_activations" and kv < w and (kv * cfg.head_dim) % w:
        problems.append(
            f"kv_strategy='gather_activations' needs kv_heads*head_dim to be a multiple of "
            f"world_size, so each rank projects an equal slice of K/V "
            f"(got kv_heads={kv}, head_dim={cfg.head_dim}, world_size={w})")
    return problems


def _surrounding_problems(cfg: Config) -> list[str]:
    """The rules of ``data_parallel``, ``dropout`` and ``qk_norm`` that ``cfg`` breaks."""
    problems = []
    dp = cfg.data_parallel
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        problems.append(f"data_parallel must be an integer >= 1 (got {dp!r})")
    p = cfg.dropout
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        problems.append(f"dropout must be a number in [0, 1) (got {p!r})")
    if not isinstance(cfg.qk_norm, bool):
        problems.append(f"qk_norm must be True or False (got {cfg.qk_norm!r})")
    plain = not cfg.sequence_parallel and cfg.kv_heads >= cfg.world_size
    for name, on in (("dropout > 0", isinstance(p, (int, float)) and not isinstance(p, bool)
                      and p > 0), ("qk_norm", cfg.qk_norm is True)):
        if on and not plain:
            problems.append(
                f"{name} needs plain TP: sequence_parallel=False and kv_heads >= world_size "
                f"(got sequence_parallel={cfg.sequence_parallel}, kv_heads={cfg.kv_heads}, "
                f"world_size={cfg.world_size})")
    return problems
