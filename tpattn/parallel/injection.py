"""``Injection``: how the sharded block is wired and trained (the defaults are correct TP).

Every mode of the bug registry (``tpattn.bugs.zoo.REGISTRY``) is one ``Injection``;
``program()`` turns its fields into the stages the engine runs (``parallel.wrong.program_of``),
nothing compares mode names. The class docstring lists the knobs.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Injection"]


@dataclass(frozen=True)
class Injection:
    """How the sharded block is built and trained; the defaults are correct TP::

        f      backward of the copy to ranks (under sequence parallelism: of the
               all-gather): "sum" (correct), "none", "mean", "twice"
        g      how many times the output partials are all-reduced (under sequence
               parallelism: reduce-scattered): 1 (correct), 0, 2
        bias   output-projection bias: None, "after_g" (correct), "every_rank"
               (before g)
        shard  "heads" (correct), "fused" (a fused [Wq; Wk; Wv] split by heads),
               "fused_naive" (cut in contiguous slices)
        kv     "interleave" (repeat_kv, correct) or "tile" (K/V heads tiled on
               each rank)
        inputs "replicated" (correct) or "per_rank" (each rank draws its own
               batch)
        norm   the logged/clipping gradient norm: "once" (correct) or "per_rank"
               (replicated parameters counted once per rank); ``clip`` turns
               clipping on
        kv_grad    with replicated KV heads, the replica-group reduce of the wk/wv
               gradients: "sum" (correct) or "none"
        norm_grad  under sequence parallelism, the all-reduce of the norm weight's
               gradient: "sum" (correct), "mean" (averaged), "none" (dropped)

    Around the block (``Config.data_parallel``, ``dropout``, ``qk_norm``; chapter "Around the
    block"):

        shard      also "fused_rank0" (every rank narrows rank 0's rows of a fused
               [Wq; Wk; Wv]), "grouped" (a checkpoint fused per KV group,
               [q_g; k_g; v_g] for each group g, read as such: correct) and
               "grouped_as_plain" (that checkpoint read as plain [Q; K; V])
        loss_group the group the logged loss is all-reduced over (SUM of every
               rank's share of the global mean): "dp" (correct), "world" (every
               rank of the mesh), "tp" (the loss's own TP mesh only, as a
               Replicate DTensor's full_tensor() does: no reduction at all)
        dp_grad    the group of the data-parallel gradient all-reduce: "dp"
               (correct) or "self" (a group of one rank: a silent no-op)
        sp_group   under sequence parallelism on a TP x DP mesh, the group of the
               all-gather/reduce-scatter along the sequence: "tp" (correct) or
               "dp" (the other mesh dimension's group, of the same size)
        rng        the default torch RNG of the TP ranks: "synced" (correct) or
               "rank0_drift" (tp_rank 0 draws once more before the step, as a
               data loader drawing its workers' base seed does)
        qk_norm_grad  with ``Config.qk_norm``, the TP all-reduce of the q/k-norm
               weights' gradients: "sum" (correct) or "none"

    ``rank_lr_scale`` (one learning-rate factor per rank; 0 keeps that rank's pre-step
    weights), ``partial_scale`` (every rank's attention partial times a factor before g, or a
    tuple of one factor per rank) and ``shard_offset`` (rank r loads the shards of rank
    ``(r + k) mod W``) are no registry bugs: the held-out evaluation's made-up bugs
    (``tpattn.bugs.made_up``).
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
        """The bug-free twin: the same setup (bias present, clipping, fused checkpoint), every
        collective and layout right."""
        shard = {"fused_naive": "fused", "fused_rank0": "fused", "fused": "fused",
                 "grouped": "grouped", "grouped_as_plain": "grouped"}.get(self.shard, "heads")
        return Injection(bias="after_g" if self.bias else None, clip=self.clip, shard=shard)

    @property
    def reduction_only(self) -> bool:
        """True when the program is correct TP on the original fixture's setup with only its
        reductions changed: f ``"sum"``/``"none"``, g 1/0, any ``norm_grad``, any
        ``kv_grad``; every other knob at its default (the original fixture's check's modes)."""
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
