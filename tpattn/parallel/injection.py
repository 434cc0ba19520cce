"""``Injection``: how the sharded block is wired and trained; ``program()`` its engine stages."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Injection"]


@dataclass(frozen=True)
class Injection:
    """How the sharded block is built and trained; the defaults are correct TP::

        f             backward of the copy to ranks (SP: of the
                      all-gather): "sum", "none", "mean", "twice"
        g             times the partials are all-reduced (SP:
                      reduce-scattered): 1, 0, 2
        bias          output bias: None, "after_g" (correct),
                      "every_rank" (before g)
        shard         "heads", "fused" ([Wq; Wk; Wv] split by heads),
                      "fused_naive" (contiguous slices), "fused_rank0"
                      (rank 0's rows on every rank), "grouped" (per-KV-
                      group checkpoint), "grouped_as_plain" (read as
                      [Q; K; V])
        kv            "interleave" (repeat_kv) or "tile" (KV heads
                      tiled on each rank)
        inputs        "replicated" or "per_rank" (each rank draws its
                      own batch)
        norm          logged/clipping gradient norm: "once" or
                      "per_rank"; clip: clip it
        kv_grad       replicated KV heads' wk/wv gradient reduce: "sum"
                      or "none"
        norm_grad     SP's norm-gradient all-reduce: "sum", "mean",
                      "none"
        loss_group    the logged loss's all-reduce group: "dp",
                      "world", "tp" (none)
        dp_grad       the DP gradient all-reduce's group: "dp" or
                      "self" (a no-op)
        sp_group      SP's gather/scatter group on a TP x DP mesh:
                      "tp" or "dp"
        rng           TP ranks' default RNG: "synced" or "rank0_drift"
                      (rng module)
        qk_norm_grad  the q/k-norm gradients' TP all-reduce: "sum" or
                      "none"

    The held-out evaluation's made-up bugs (``tpattn.bugs.made_up``), no registry entries:
    ``rank_lr_scale`` (a learning-rate factor per rank), ``partial_scale`` (the partials
    times a factor, or one per rank, before g), ``shard_offset`` (rank r loads rank
    ``(r + k) mod W``'s shards).
    """

    f: str = "sum"
    g: int = 1
    bias: str | None = None
    shard: str = "heads"
    kv: str = "interleave"
    inputs: str = "replicated"
    norm: str = "once"
    clip: bool = False
    rank_lr_scale: tuple = ()
    kv_grad: str = "sum"
    norm_grad: str = "sum"
    partial_scale: float | tuple = 1.0
    shard_offset: int = 0
    loss_group: str = "dp"
    dp_grad: str = "dp"
    sp_group: str = "tp"
    rng: str = "synced"
    qk_norm_grad: str = "sum"

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
                "fused_qkv": self.shard in ("fused", "fused_naive", "fused_rank0", "grouped",
                                            "grouped_as_plain")}
