"""``Injection``: how the sharded block is wired and trained; ``program()`` its engine stages."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Injection"]


@dataclass(frozen=True)
class Injection:
    """How the sharded block is built and trained; the defaults are correct TP. Made up: the
    held-out evaluation's bugs (``tpattn.bugs.made_up``), no registry entries."""

    f: str = "sum"  # f's backward (SP: the all-gather's): "sum", "none", "mean", "twice"
    g: int = 1  # times the partials are all-reduced (SP: reduce-scattered): 1, 0, 2
    bias: str | None = None  # output bias: None, "after_g" (correct), "every_rank" (before g)
    # "heads", "fused" ([Wq; Wk; Wv] split by heads), "fused_naive" (contiguous slices),
    # "fused_rank0" (rank 0's rows on every rank), "grouped" (per-KV-group checkpoint),
    # "grouped_as_plain" (read as [Q; K; V])
    shard: str = "heads"
    kv: str = "interleave"  # "interleave" (repeat_kv) or "tile" (KV heads tiled on each rank)
    inputs: str = "replicated"  # or "per_rank" (each rank draws its own batch)
    norm: str = "once"  # the logged/clipping gradient norm: "once" or "per_rank"
    clip: bool = False  # clip the gradient norm
    rank_lr_scale: tuple = ()  # made up: a learning-rate factor per rank
    kv_grad: str = "sum"  # replicated KV heads' wk/wv gradient reduce: "sum" or "none"
    norm_grad: str = "sum"  # SP's norm-gradient all-reduce: "sum", "mean", "none"
    partial_scale: float | tuple = 1.0  # made up: the partials times it (or one per rank) before g
    shard_offset: int = 0  # made up: rank r loads rank (r + k) mod W's shards
    loss_group: str = "dp"  # the logged loss's all-reduce group: "dp", "world", "tp" (none)
    dp_grad: str = "dp"  # the DP gradient all-reduce's group: "dp" or "self" (a no-op)
    sp_group: str = "tp"  # SP's gather/scatter group on a TP x DP mesh: "tp" or "dp"
    rng: str = "synced"  # TP ranks' default RNG: "synced" or "rank0_drift" (rng module)
    qk_norm_grad: str = "sum"  # the q/k-norm gradients' TP all-reduce: "sum" or "none"

    def correct(self) -> "Injection":
        """The bug-free twin: the same setup (bias, clipping, fused checkpoint), all else right."""
        shard = {"fused_naive": "fused", "fused_rank0": "fused", "fused": "fused",
                 "grouped": "grouped", "grouped_as_plain": "grouped"}.get(self.shard, "heads")
        return Injection(bias="after_g" if self.bias else None, clip=self.clip, shard=shard)

    @property
    def reduction_only(self) -> bool:
        """Only f, g, ``norm_grad`` or ``kv_grad`` dropped: the original fixture's modes."""
        return self.f in ("sum", "none") and self.g in (0, 1) \
            and Injection(f=self.f, g=self.g, norm_grad=self.norm_grad,
                          kv_grad=self.kv_grad) == self

    def program(self):
        """The ``Program`` this injection runs (``tpattn.parallel.wrong.program_of``)."""
        from .wrong import program_of  # wrong -> program -> collectives: below, not above
        return program_of(self)

    @property
    def setup(self) -> dict:
        """What the engineer knows about the model and the training setup (not the bug)."""
        return {"bias": self.bias is not None, "grad_clip": self.clip,
                "fused_qkv": self.correct().shard != "heads"}
