"""Sequence parallelism (SP): the TP block with the residual stream sharded along the sequence.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), as Megatron-LM runs it with ``--sequence-parallel``. Between blocks, each of
the ``W`` TP ranks holds only its own ``S/W`` consecutive tokens of ``x`` (``[S/W, B, hidden]``),
and RMSNorm runs on those tokens with its weight replicated. Megatron's f and g become::

                 all-gather                                   reduce-scatter
    x_r ─ norm ─ along seq ─┬─ rank 0: Q/K/V ─ attn ─ wo ─┬─ sum, keep ── (+ x_r)
    [S/W]        [S]        └─ rank 1: ...         P_r [S]┘ my S/W tokens
    (backward: reduce-scatter of dn)        (backward: all-gather of dy)

- **all-gather** (replaces f): forward, every rank receives all ``S`` tokens of ``n``;
  backward, a *reduce-scatter*: rank r keeps its tokens of the sum of every rank's ``dn``.
- **reduce-scatter** (replaces g): forward, rank r keeps its tokens of the sum of the ranks'
  output partials; backward, an *all-gather* of ``dy``.
- The attention runs on the gathered sequence, so RoPE sees global positions ``0..S-1``. Code
  that applies RoPE to a rank's own tokens must start at ``r * S/W``
  (``apply_rope(q_r, offset=r * S // W)``; Megatron's ``get_rotary_seq_len`` multiplies the
  local length by the TP size for the same reason).
- The ``norm`` weight sees only the rank's tokens, so its gradient is a **partial sum**: it
  needs an all-reduce over the TP group after the backward pass (Megatron marks such weights
  ``sequence_parallel`` and reduces them in ``finalize_model_grads``). Dropping it
  (``missing_norm_grad_reduce``) or averaging instead of summing (``norm_grad_averaged``) is a
  bug that forward, loss and dX cannot see.

The loss is the global MSE: rank r back-propagates its share ``sum((y_r - t_r)**2) / numel``,
and the reported loss is the MSE of the ranks' outputs put together (no collective in the
block's gradient path).

The block under SP, three ways:

- the fixture's one-graph model (``simulate="fixture"``), see below: the engine's block
  (``tpattn.parallel.engine``) under ``Config.sequence_parallel`` on
  ``tpattn.parallel.one_graph.OneGraphRanks``;
- every simulated rank its own tensors (``simulate="ranks"``): the same block on
  ``tpattn.parallel.collectives.SimulatedRanks``, which gather and scatter over the rank
  dimension;
- ``tpattn.real.ranks.real_rank_block`` — one real ``torch.distributed`` rank, the
  collectives ``all_gather_single`` / ``reduce_scatter_single`` (torch 2.13's names for
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; gloo has both on CPU).

**Rank 0's view under SP** (``simulate="fixture"``). The original fixture's model has one copy of every
tensor; a rank's piece is a view of it, a collective that runs costs nothing (autograd sums the
gradients of every use of a tensor), and a *dropped* collective is modelled as rank 0 sees it:
only rank 0's contribution reaches the shared tensor, ranks 1.. are detached. Under SP that
gives: without the reduce-scatter every token's output is ``x + P_0`` (rank 0's partial);
without the all-gather's backward, ``dn`` holds rank 0's contribution only; without the norm
all-reduce, ``norm``'s gradient is rank 0's tokens' share. The forward output, loss and dX are
the ranks' shards put together. For the original fixture's three modes this is exactly the TP fixture's
model (SP changes where tensors live, not the arithmetic of one graph), and it is *not* what
real ranks compute for a dropped reduce-scatter or all-gather backward — there rank r uses its
own partial and its own ``dn`` on its own tokens; ``simulate="ranks"`` models that.
"""
from __future__ import annotations

import torch

from tpattn.config import Config
from tpattn.block.layers import rms_norm
from .kv_heads import ring_bytes
from .wrong import ScaleGrad

__all__ = ["NORM_GRAD_REDUCTIONS", "rank_tokens", "ScaleGrad", "ring_bytes",
           "communication_ledger", "norm_activation_bytes"]

#: How the ranks' ``norm`` gradients are combined after backward: ``"sum"`` (correct, an
#: all-reduce), ``"mean"`` (the ``norm_grad_averaged`` bug), ``"none"`` (dropped).
NORM_GRAD_REDUCTIONS = ("sum", "mean", "none")


def rank_tokens(cfg: Config, rank: int) -> slice:
    """The positions of the sequence rank ``rank`` holds under SP: ``[r*S/W, (r+1)*S/W)``."""
    local = cfg.seq // cfg.world_size
    return slice(rank * local, (rank + 1) * local)


# --- what the collectives cost ----------------------------------------------------------

def communication_ledger(cfg: Config) -> list[dict]:
    """The collectives one correct training step of the block issues, without and with SP.

    One row per collective: ``variant`` (``"TP"``/``"SP"``), ``collective``, ``phase``,
    ``elements`` of the whole tensor and ``bytes_per_rank`` sent (``ring_bytes``). TP: g's and
    f's all-reduces of ``[S, B, hidden]``. SP: two all-gathers and two reduce-scatters of the
    same size, plus the all-reduce of the ``norm`` gradient (``[hidden]``).
    """
    w, item = cfg.world_size, torch.empty((), dtype=cfg.torch_dtype).element_size()
    act, hid = cfg.seq * cfg.batch * cfg.hidden, cfg.hidden
    rows = [("TP", "all_reduce", "forward", act, "g: sum of output partials"),
            ("TP", "all_reduce", "backward", act, "f: sum of dn"),
            ("SP", "all_gather", "forward", act, "n along the sequence"),
            ("SP", "reduce_scatter", "forward", act, "output partials"),
            ("SP", "all_gather", "backward", act, "dy (reduce-scatter's backward)"),
            ("SP", "reduce_scatter", "backward", act, "dn (all-gather's backward)"),
            ("SP", "all_reduce", "after backward", hid, "norm weight's gradient")]
    return [{"variant": v, "collective": c, "phase": p, "what": what, "elements": n,
             "bytes_per_rank": float(ring_bytes(c, n, w, item))} for v, c, p, n, what in rows]


def norm_activation_bytes(cfg: Config) -> int:
    """Bytes one rank's RMSNorm saves for backward (its activations; the weight excluded),
    measured with ``torch.autograd.graph.saved_tensors_hooks`` on ``cfg.local_seq`` tokens."""
    x = torch.randn(cfg.local_seq, cfg.batch, cfg.hidden, dtype=cfg.torch_dtype, requires_grad=True)
    weight = torch.ones(cfg.hidden, dtype=cfg.torch_dtype, requires_grad=True)
    saved = []

    def pack(t):
        if t.data_ptr() != weight.data_ptr():
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rms_norm(x, weight, cfg.eps)
    return sum(saved)
