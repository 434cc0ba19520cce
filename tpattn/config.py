"""The block's shape: one frozen, validated ``Config``.

Every other module takes a ``Config`` and trusts it, so every rule a shape must obey is checked
here, at construction time, with a ``ValueError`` that names the field and the rule.

Tensor layout used throughout the package (Megatron's sequence-first layout)::

    x            [S, B, hidden]                S = seq, B = batch
    q            [S, B, query_heads, head_dim]
    k, v         [S, B, kv_heads, head_dim]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

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
    - when ``kv_heads >= world_size``: ``kv_heads % world_size == 0`` (every rank holds complete
      query/KV groups);
    - when ``kv_heads < world_size``: ``world_size % kv_heads == 0`` (each KV head is shared by
      a *replica group* of ``world_size / kv_heads`` ranks) and ``query_heads % world_size == 0``
      (see ``tpattn.parallel.kv_heads``);
    - ``kv_strategy`` is ``"replicate_weights"`` (each rank of a replica group holds a copy of
      its KV head's wk/wv rows; their gradients are summed within the group) or
      ``"gather_activations"`` (no copies: K/V activations are all-gathered; needs
      ``kv_heads * head_dim % world_size == 0``). It matters only when ``kv_heads < world_size``;
    - ``dtype`` is ``"float32"``, ``"float64"`` or ``"bfloat16"`` (a ``torch.dtype`` is accepted and
      stored by name; bfloat16 keeps parameters and activations in bf16);
    - ``sequence_parallel`` is a bool; when ``True``, ``seq % world_size == 0`` (each rank holds
      ``seq // world_size`` consecutive tokens of the residual stream, see
      ``tpattn.parallel.sequence_parallel``).

    Three fields describe what surrounds the block (off by default, so the seed's fixture is
    unchanged; see chapter "Around the block"):

    - ``data_parallel`` is an integer ≥ 1: the data-parallel degree of a TP × DP mesh. The job
      has ``world_size * data_parallel`` ranks; ``world_size`` stays the TP degree. Each DP
      replica trains on its own ``batch`` samples (the global batch is ``batch *
      data_parallel``); gradients are all-reduced over the DP group and the logged loss over
      the DP group;
    - ``dropout`` is a number in ``[0, 1)``: the probability of attention dropout (inside the
      sharded region: a different random stream on every TP rank) and residual dropout (outside
      it: the same stream on every TP rank), as Megatron's model-parallel RNG tracker draws them;
    - ``qk_norm`` is a bool: RMSNorm on every query and key head before RoPE (weights
      ``[head_dim]``, replicated on every TP rank, as Qwen3 and Gemma 3 do).

    ``dropout > 0`` and ``qk_norm`` need plain TP layouts: no ``sequence_parallel``, and
    ``kv_heads >= world_size``.
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
    #: ``omit_default``: left out of ``repr`` at its default value (the seed's repr stays).
    sequence_parallel: bool = field(default=False, metadata={"omit_default": True})
    kv_strategy: str = field(default="replicate_weights", metadata={"omit_default": True})
    data_parallel: int = field(default=1, metadata={"omit_default": True})
    dropout: float = field(default=0.0, metadata={"omit_default": True})
    qk_norm: bool = field(default=False, metadata={"omit_default": True})

    def __repr__(self) -> str:
        """The dataclass repr, without the fields added after the seed while at their
        default value (``metadata={"omit_default": True}``), so the seed's repr stays."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if not (f.metadata.get("omit_default") and getattr(self, f.name) == f.default)]
        return f"Config({', '.join(shown)})"

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
        problems += _kv_layout_problems(self)
        if not isinstance(self.sequence_parallel, bool):
            problems.append(f"sequence_parallel must be True or False (got {self.sequence_parallel!r})")
        elif self.sequence_parallel and self.seq % self.world_size:
            problems.append(
                f"seq must be a multiple of world_size under sequence_parallel, so each rank "
                f"holds seq // world_size tokens (got seq={self.seq}, world_size={self.world_size})")
        if self.sequence_parallel is True and isinstance(self.world_size, int) \
                and self.kv_heads < self.world_size:
            problems.append(
                f"sequence_parallel needs kv_heads >= world_size: sequence parallelism with "
                f"replicated or gathered KV heads is not built (got kv_heads={self.kv_heads}, "
                f"world_size={self.world_size})")
        problems += _surrounding_problems(self)
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
        """KV heads one TP rank attends with: ``kv_heads / world_size``, or 1 (a replica, or a
        gathered head) when ``kv_heads < world_size``."""
        return max(1, self.kv_heads // self.world_size)

    @property
    def kv_replicas(self) -> int:
        """Ranks that share one KV head: ``world_size / kv_heads`` when ``kv_heads <
        world_size``, else 1."""
        return max(1, self.world_size // self.kv_heads)

    @property
    def ranks(self) -> int:
        """Ranks of the whole job: ``world_size * data_parallel`` (TP × DP)."""
        return self.world_size * self.data_parallel

    @property
    def model_options(self) -> bool:
        """True when a model option of chapter "Around the block" is on (``dropout > 0`` or
        ``qk_norm``): the one-graph view models neither, the simulated ranks run them."""
        return self.dropout > 0 or self.qk_norm

    @property
    def local_seq(self) -> int:
        """Tokens of the residual stream held by one rank under ``sequence_parallel``
        (``seq // world_size``; the whole ``seq`` otherwise)."""
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
        problems.append(
            f"query_heads must be a multiple of world_size when kv_heads < world_size "
            f"(got query_heads={q}, world_size={w})")
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
