"""Every collective of the block as an autograd Function over a backend's primitives: it holds
``R`` ranks (dim 0 of every tensor) and supplies ``group_sum``, ``group_cat``, ``scatter_sum``
(a reduce-scatter along the sequence) and ``record`` (the ledger); f, g and the others are
Functions over them, as in Megatron-LM's ``tensor_parallel/mappings.py``."""
from __future__ import annotations

import torch

from tpattn.config import Config

__all__ = ["SimulatedRanks", "check_op", "own_tokens", "CopyToRanks", "ReduceFromRanks",
           "GatherSequence", "ScatterSequence", "GatherKV", "ReduceReplicaGrads",
           "reduce_norm_grad", "reduce_qk_norm_grads", "reduce_dp_grads", "replica_share",
           "reduce_loss", "reduce_scalar", "F_LABEL", "G_LABEL", "AGAIN", "DP_GRAD_LABEL",
           "LOSS_LABEL", "SP_SHARE_LABEL", "QK_NORM_GRAD_LABEL", "NORM_GRAD_LABEL",
           "REPLICA_GRAD_LABEL", "KV_GATHER_LABEL", "KV_SCATTER_LABEL", "group_max",
           "vocab_offsets", "VocabParallelCrossEntropy", "CE_MAX_LABEL", "CE_TARGET_LABEL",
           "CE_SUM_EXP_LABEL", "CE_MEAN_LABEL", "at_least_float32", "global_mean_logit",
           "vocab_parallel_ce"]

#: Ledger labels (a collective applied a second time adds ``AGAIN``).
F_LABEL = "f: all-reduce of dn"
G_LABEL = "g: all-reduce of output partials"
AGAIN = " (again)"
QK_NORM_GRAD_LABEL = "all-reduce of the q/k-norm weights' gradients"
NORM_GRAD_LABEL = "all-reduce of the norm weight's gradient"
REPLICA_GRAD_LABEL = "all-reduce of wk/wv grads in the replica group"
KV_GATHER_LABEL = "all-gather of K/V activations"
KV_SCATTER_LABEL = "reduce-scatter of K/V activation grads"
DP_GRAD_LABEL = "all-reduce of gradients over the DP group"
LOSS_LABEL = "all-reduce of the logged loss"
SP_SHARE_LABEL = "all-reduce of the loss shares over the TP group"
CE_MAX_LABEL = "cross-entropy: the group's max of the logit maxima (all-gather, then max)"
CE_TARGET_LABEL = "cross-entropy: all-reduce of the target logits"
CE_SUM_EXP_LABEL = "cross-entropy: all-reduce of the sums of exponentials"
CE_MEAN_LABEL = "cross-entropy: all-reduce of the sums of logits (label smoothing)"


def check_op(op: str) -> str:
    """``op`` if it is a reduction f can run (``"sum"``, ``"avg"``), else ``ValueError``."""
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg' (got {op!r})")
    return op


def own_tokens(full: torch.Tensor, comm, group: str = "tp") -> torch.Tensor:
    """Each rank's ``S/W`` tokens (by its place in ``group``): ``[R, S, ...]`` -> ``[R, S/W, ...]``."""
    return torch.stack([full[i].chunk(comm.world_size, dim=0)[comm.position(i, group)]
                        for i in range(full.shape[0])])


class SimulatedRanks:
    """Every rank of the job in one process, dim 0 in mesh order (``i = dp * W + tp``)."""

    def __init__(self, cfg: Config, ledger: list | None = None):
        self.cfg, self.ledger = cfg, ledger
        self.world_size, self.data_parallel = cfg.world_size, cfg.data_parallel
        #: Each entry's TP rank and DP rank.
        self.ranks = [i % cfg.world_size for i in range(cfg.ranks)]
        self.dp_ranks = [i // cfg.world_size for i in range(cfg.ranks)]

    def groups(self, group: str = "tp") -> list[list[int]]:
        """The entries of each group of ``group`` in group order: ``"tp"`` consecutive, ``"dp"``
        one per DP rank, ``"world"``, ``"kv_replicas"`` (the ranks sharing a KV head), ``"self"``."""
        w, d, r = self.world_size, self.data_parallel, self.cfg.kv_replicas
        groups = {"tp": [[i * w + t for t in range(w)] for i in range(d)],
                  "dp": [[i * w + t for i in range(d)] for t in range(w)],
                  "world": [list(range(w * d))],
                  "kv_replicas": [list(range(s, s + r)) for s in range(0, w * d, r)],
                  "self": [[i] for i in range(w * d)]}
        if group not in groups:
            raise ValueError(f"group must be 'tp', 'dp', 'world', 'kv_replicas' or 'self' "
                             f"(got {group!r})")
        return groups[group]

    def position(self, entry: int, group: str = "tp") -> int:
        """Entry ``entry``'s rank inside its group of ``group``."""
        return next(m.index(entry) for m in self.groups(group) if entry in m)

    def _per_group(self, t: torch.Tensor, group: str, combine) -> torch.Tensor:
        """Every entry of ``t`` ``[R, ...]`` replaced by ``combine`` of its group's entries."""
        out = [None] * t.shape[0]
        for members in self.groups(group):
            combined = combine([t[m] for m in members])
            for m in members:
                out[m] = combined
        return torch.stack(out)

    def group_sum(self, t: torch.Tensor, group: str = "tp") -> torch.Tensor:
        """Every entry of ``t`` ``[R, ...]`` replaced by its group's sum, ``t[0] + t[1] + ...``."""
        return self._per_group(t, group, lambda parts: sum(parts[1:], parts[0]))

    def group_cat(self, t: torch.Tensor, dim: int, group: str = "tp") -> torch.Tensor:
        """Every entry of ``t`` ``[R, ...]``: its group's entries joined along its ``dim``."""
        return self._per_group(t, group, lambda parts: torch.cat(parts, dim=dim))

    def scatter_sum(self, t: torch.Tensor, group: str = "tp") -> torch.Tensor:
        """Reduce-scatter along the sequence: each rank's ``S/W`` tokens of its group's sum."""
        return own_tokens(self.group_sum(t, group), self, group).contiguous()

    def record(self, phase: str, label: str, collective: str = "all_reduce",
               group: str = "tp", op: str | None = "sum") -> None:
        """Append one entry to the ledger (if there is one)."""
        if self.ledger is not None:
            self.ledger.append({"collective": collective, "phase": phase, "group": group,
                                "label": label, "op": op})


def group_max(t: torch.Tensor, comm, label: str, group: str = "tp") -> torch.Tensor:
    """Every entry of ``t`` ``[R, ...]`` replaced by its group's elementwise max: an all-gather
    (``group_cat``, so every backend has it), then the max; ledger op ``"max"``."""
    comm.record("forward", label, "all_gather", group, "max")
    return comm.group_cat(t.unsqueeze(1), 0, group).amax(dim=1)


def vocab_offsets(comm, local_vocab: int) -> torch.Tensor:
    """Each entry's first vocabulary row, ``tp_rank * local_vocab``: ``[R, 1, 1]`` int64."""
    return (torch.tensor(comm.ranks) * local_vocab).view(-1, 1, 1)


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 if its dtype is narrower (bfloat16), else ``t`` itself."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def global_mean_logit(shifted: torch.Tensor, comm) -> tuple[torch.Tensor, int]:
    """Each token's mean shifted logit over the whole vocabulary ``[R, S, B]`` (the slices'
    sums all-reduced over the group, divided by ``V``), and ``V``: label smoothing's terms."""
    vocab = shifted.shape[-1] * comm.world_size
    comm.record("forward", CE_MEAN_LABEL)
    return comm.group_sum(shifted.sum(-1), "tp") / vocab, vocab


def vocab_parallel_ce(ctx, logits, target, comm, smoothing: float, mean_logit) -> torch.Tensor:
    """``VocabParallelCrossEntropy``'s forward, label smoothing's mean logit and vocabulary
    size from ``mean_logit(shifted, comm)``: per-token loss ``[R, S, B]``."""
    ctx.dtype, ctx.smoothing = logits.dtype, smoothing
    logits = at_least_float32(logits)
    v = logits.shape[-1]
    shifted = logits - group_max(logits.amax(-1), comm, CE_MAX_LABEL).unsqueeze(-1)
    local = target - vocab_offsets(comm, v)
    owned = (local >= 0) & (local < v)  # only the owner's target logit counts
    index = torch.where(owned, local, 0).unsqueeze(-1)
    picked = torch.where(owned, shifted.gather(-1, index).squeeze(-1), 0.0)
    comm.record("forward", CE_TARGET_LABEL)
    picked = comm.group_sum(picked, "tp")
    exp = shifted.exp()
    comm.record("forward", CE_SUM_EXP_LABEL)
    sum_exp = comm.group_sum(exp.sum(-1), "tp")
    ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), index, owned)
    loss = sum_exp.log() - picked
    if smoothing:  # (1 - a)(lse - z_t) + a (lse - mean z) = (lse - z_t) + a (z_t - mean z)
        mean, ctx.vocab = mean_logit(shifted, comm)
        loss = loss + smoothing * (picked - mean)
    return loss


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocabulary-parallel cross-entropy: logits ``[R, S, B, V/W]`` (rank r: rows
    ``r*V/W ..``), target ``[R, S, B]`` -> per-token loss ``[R, S, B]``, the same on every TP
    rank; the max, target logit and sum of exponentials reduced over the group (with
    ``smoothing`` > 0 also the sum of logits: ``F.cross_entropy``'s label smoothing over the
    whole vocabulary), backward local. Computed in at least float32 (Megatron's
    ``logits.float()``), the gradient in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits, target, comm, smoothing=0.0):
        return vocab_parallel_ce(ctx, logits, target, comm, smoothing, global_mean_logit)

    @staticmethod
    def backward(ctx, grad):
        softmax, index, owned = ctx.saved_tensors
        one_hot = torch.zeros_like(softmax).scatter_(-1, index, owned.unsqueeze(-1).to(softmax))
        d = softmax - one_hot
        if ctx.smoothing:
            d = d + ctx.smoothing * (one_hot - 1 / ctx.vocab)
        return (d * grad.unsqueeze(-1)).to(ctx.dtype), None, None, None


class CopyToRanks(torch.autograd.Function):
    """f: ``n`` ``[R, S, B, hidden]`` unchanged; backward its TP group's sum of dn (``"avg"``:
    / W)."""

    @staticmethod
    def forward(ctx, n, comm, label=F_LABEL, op="sum"):
        ctx.comm, ctx.label, ctx.op = comm, label, check_op(op)
        return n.view_as(n)

    @staticmethod
    def backward(ctx, dn):
        ctx.comm.record("backward", ctx.label, op=ctx.op)
        total = ctx.comm.group_sum(dn, "tp")
        return total / ctx.comm.world_size if ctx.op == "avg" else total, None, None, None


class ReduceFromRanks(torch.autograd.Function):
    """g: every rank gets its TP group's sum of ``partial`` ``[R, S, B, hidden]``; backward
    the identity."""

    @staticmethod
    def forward(ctx, partial, comm, label=G_LABEL):
        comm.record("forward", label)
        return comm.group_sum(partial, "tp")

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None


class GatherSequence(torch.autograd.Function):
    """In f's place under SP: ``n`` ``[R, S/W, B, hidden]`` -> ``[R, S, B, hidden]``, the
    group's tokens in group order (``group``: ``"tp"``); backward a reduce-scatter of dn."""

    @staticmethod
    def forward(ctx, n, comm, group="tp"):
        ctx.comm, ctx.group = comm, group
        comm.record("forward", "all-gather of n along the sequence", "all_gather", group, None)
        return comm.group_cat(n, 0, group)

    @staticmethod
    def backward(ctx, dn):
        ctx.comm.record("backward", "reduce-scatter of dn", "reduce_scatter", ctx.group)
        return ctx.comm.scatter_sum(dn, ctx.group), None, None


class ScatterSequence(torch.autograd.Function):
    """In g's place under SP: ``partial`` ``[R, S, B, hidden]`` -> ``[R, S/W, B, hidden]``,
    each rank's tokens of its TP group's sum; backward an all-gather of dy."""

    @staticmethod
    def forward(ctx, partial, comm):
        ctx.comm = comm
        comm.record("forward", "reduce-scatter of output partials", "reduce_scatter")
        return comm.scatter_sum(partial, "tp")

    @staticmethod
    def backward(ctx, dy):
        ctx.comm.record("backward", "all-gather of dy", "all_gather", op=None)
        return ctx.comm.group_cat(dy, 0, "tp"), None


class GatherKV(torch.autograd.Function):
    """The K/V all-gather: ``local`` ``[R, S, B, c]`` -> ``[R, S, B, W*c]`` (TP rank order);
    backward a reduce-scatter on the last dim (rank r: chunk r of the group's sum)."""

    @staticmethod
    def forward(ctx, local, comm):
        ctx.comm = comm
        comm.record("forward", KV_GATHER_LABEL, "all_gather", op=None)
        return comm.group_cat(local, -1, "tp")

    @staticmethod
    def backward(ctx, grad):
        ctx.comm.record("backward", KV_SCATTER_LABEL, "reduce_scatter")
        chunks = ctx.comm.scatter_sum(grad.movedim(-1, 1), "tp")  # rank r: chunk r, last dim
        return chunks.movedim(1, -1).contiguous(), None


class ReduceReplicaGrads(torch.autograd.Function):
    """``(wk, wv)`` ``[R, rows, hidden]`` unchanged; backward every rank gets its KV replica
    group's sum of both gradients (one all-reduce of the two, flattened)."""

    @staticmethod
    def forward(ctx, wk, wv, comm):
        ctx.comm = comm
        return wk.view_as(wk), wv.view_as(wv)

    @staticmethod
    def backward(ctx, gk, gv):
        ctx.comm.record("backward", REPLICA_GRAD_LABEL, group="kv_replicas")
        both = torch.cat([gk.flatten(1), gv.flatten(1)], dim=1)
        both = ctx.comm.group_sum(both, "kv_replicas")
        k = gk[0].numel()
        return both[:, :k].reshape(gk.shape), both[:, k:].reshape(gv.shape), None


# --- after backward and in the step: sums over a group, no autograd --------------------------

def reduce_norm_grad(grad: torch.Tensor, comm) -> torch.Tensor:
    """SP's ``norm`` gradient ``[R, hidden]`` after backward: every rank its TP group's sum."""
    comm.record("after backward", NORM_GRAD_LABEL)
    return comm.group_sum(grad, "tp").clone()


def reduce_qk_norm_grads(gq: torch.Tensor, gk: torch.Tensor, comm):
    """The q/k-norm gradients ``[R, head_dim]``: each its TP group's sum (one all-reduce)."""
    comm.record("after backward", QK_NORM_GRAD_LABEL)
    total = comm.group_sum(torch.cat([gq, gk], dim=1), "tp").clone()
    return total[:, :gq.shape[1]].clone(), total[:, gq.shape[1]:].clone()


def reduce_dp_grads(grads: dict[str, torch.Tensor], comm,
                    group: str = "dp") -> dict[str, torch.Tensor]:
    """Every gradient ``[R, ...]`` summed over its group of ``group`` (the DP all-reduce)."""
    comm.record("after backward", DP_GRAD_LABEL, group=group)
    return {k: comm.group_sum(g, group) for k, g in grads.items()}


def replica_share(share: torch.Tensor, comm) -> torch.Tensor:
    """Under SP on a mesh: every rank's loss share ``[R]`` summed over its TP group."""
    comm.record("step", SP_SHARE_LABEL)
    return comm.group_sum(share.reshape(-1, 1), "tp")[:, 0]


def reduce_loss(share: torch.Tensor, comm, group: str = "dp") -> torch.Tensor:
    """The logged loss ``[R]``: the shares ``[R]`` summed over ``group`` (``"tp"``: kept as is)."""
    if group == "tp":
        return share.clone()
    comm.record("step", LOSS_LABEL, group=group)
    return comm.group_sum(share.reshape(-1, 1), group)[:, 0]


def reduce_scalar(value: torch.Tensor, comm, label: str) -> torch.Tensor:
    """``value`` ``[R]`` summed over each TP group: a scalar, or ``[R]`` on a TP x DP mesh."""
    comm.record("step", label)
    total = comm.group_sum(value.reshape(value.shape[0], -1), "tp")[:, 0]
    return total[0] if comm.data_parallel == 1 else total
