"""The block's collectives as a parameter: simulated ranks in one process.

``tpattn.parallel.engine.rank_block`` is written for the ranks ONE process holds: every tensor
carries a leading local-rank dimension ``[R, ...]``. It calls the collectives on an object
passed in, the way Megatron-LM's ``tensor_parallel/mappings.py`` takes the process group::

  copy_to_ranks(n)            f: identity; backward all-reduce of dn
  reduce_output(partial)      g: all-reduce; backward identity
  gather_sequence(n, reduce)  SP's f: all-gather along the sequence;
                              backward reduce-scatter (``reduce=False``:
                              this rank's tokens of its own gradient)
  reduce_scatter_sequence(p)  SP's g: reduce-scatter along the sequence;
                              backward all-gather
  gather_kv(local)            K/V all-gather on the last dim; backward
                              reduce-scatter
  reduce_replica_grads(k, v)  identity; backward all-reduce of the wk/wv
                              gradients within each KV replica group
  reduce_norm_grad(g, how)    after backward: SP's norm-gradient all-reduce
  reduce_qk_norm_grads(q, k)  after backward: the q/k-norm weights' gradient
                              all-reduce (one collective for both)
  reduce_dp_grads(grads, grp) after backward, on a TP x DP mesh: the data-
                              parallel gradient all-reduce ("dp"; "self": a
                              group of one rank, a no-op)
  reduce_loss(share, grp)     the logged loss: all-reduce SUM of the shares
                              over "dp", "world" (the whole mesh), or "tp"
                              (no reduction: a Replicate DTensor's
                              full_tensor() on the TP mesh)

``SimulatedRanks`` holds every rank of the job (``R = cfg.ranks = world_size *
data_parallel``) in mesh order: entry ``i`` is global rank ``i = dp_rank * world_size +
tp_rank`` (``init_device_mesh(..., (data_parallel, world_size), ("dp", "tp"))``). Each
collective is a sum or a concatenation over the entries of one group, in group order
(``t[a] + t[b] + ...``, as the all-reduces of a ring of real ranks are modelled elsewhere in
the package): the TP collectives over each TP group (``world_size`` consecutive entries), the
DP gradient all-reduce over each DP group (the entries of one ``tp_rank``). With
``data_parallel == 1`` there is one TP group, every entry, as plain TP. A ``ledger`` list, when given, records every
collective as ``{"collective", "phase", "group", "label", "op"}`` when it runs (backward
ones during backward; ``op``: the reduction the program asked for, ``"sum"`` or ``"avg"``,
``None`` for a gather). ``f`` and ``g`` may be replaced by a reader's own ``torch.autograd.Function``
subclasses whose ``apply(*tensors)`` maps one tensor per rank to one per rank (the exercises'
contract). ``tpattn.real.backend.RealRanks`` is this class for one real torch.distributed
rank (``R = 1``): it overrides only ``group_sum``, ``group_cat``, ``scatter_sum`` and ``position``.
"""
from __future__ import annotations

import torch

from tpattn.config import Config

__all__ = ["SimulatedRanks", "rank_sum", "F_LABEL", "G_LABEL", "DP_GRAD_LABEL", "LOSS_LABEL",
           "SP_SHARE_LABEL"]

#: Ledger label of the after-backward all-reduce of the q/k-norm weights' gradients.
QK_NORM_GRAD_LABEL = "all-reduce of the q/k-norm weights' gradients"
#: Ledger labels of f's and g's all-reduces (a second one adds " (again)").
F_LABEL = "f: all-reduce of dn"
G_LABEL = "g: all-reduce of output partials"


def rank_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 in rank order (``t[0] + t[1] + ...``), as ``[1, ...]``."""
    total = t[0]
    for r in range(1, t.shape[0]):
        total = total + t[r]
    return total.unsqueeze(0)


class _Collective(torch.autograd.Function):
    """One simulated collective: ``apply(t, forward_fn, backward_fn)``; each fn maps a
    ``[R, ...]`` tensor to a ``[R, ...]`` tensor (the forward's output, the input's grad)."""

    @staticmethod
    def forward(ctx, t, forward_fn, backward_fn):
        ctx.backward_fn = backward_fn
        return forward_fn(t)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad), None, None


class _ReplicaReduce(torch.autograd.Function):
    """Identity forward on ``(wk, wv)``; backward ``reduce_fn(gk, gv)`` on both gradients at
    once (one collective, as a real rank all-reduces them in one flat buffer)."""

    @staticmethod
    def forward(ctx, wk, wv, reduce_fn):
        ctx.reduce_fn = reduce_fn
        return wk.view_as(wk), wv.view_as(wv)

    @staticmethod
    def backward(ctx, gk, gv):
        return (*ctx.reduce_fn(gk, gv), None)


#: Ledger labels of the collectives of a TP x DP mesh.
DP_GRAD_LABEL = "all-reduce of gradients over the DP group"
LOSS_LABEL = "all-reduce of the logged loss"
SP_SHARE_LABEL = "all-reduce of the loss shares over the TP group"


class SimulatedRanks:
    """Every rank of the job (``cfg.ranks``) in one process, as dim 0 of every tensor, in mesh
    order (module docstring).

    ``ledger``: a list to record the collectives in (``None``: record nothing). ``f``, ``g``:
    optional ``torch.autograd.Function`` subclasses with ``apply(*tensors)`` (one ``[...]``
    per rank in, one per rank out) used in place of f and g (plain TP only).
    """

    def __init__(self, cfg: Config, ledger: list | None = None, f=None, g=None):
        self.cfg, self.ledger, self.f, self.g = cfg, ledger, f, g
        self.world_size = cfg.world_size
        self.data_parallel = cfg.data_parallel
        #: Each entry's TP rank (its rank in its TP group: the engine's heads and tokens).
        self.ranks = [i % cfg.world_size for i in range(cfg.ranks)]
        #: Each entry's DP rank (the replica it belongs to).
        self.dp_ranks = [i // cfg.world_size for i in range(cfg.ranks)]

    def groups(self, group: str = "tp") -> list[list[int]]:
        """The entries of each group of ``group`` (``"tp"``, ``"dp"``, ``"world"``,
        ``"kv_replicas"``, ``"self"``), each list in group order: TP groups are consecutive
        entries, DP groups one ``tp_rank`` each, KV replica groups ``cfg.kv_replicas``
        consecutive entries (the TP ranks that share one KV head), ``"self"`` each entry
        alone."""
        w, d = self.world_size, self.data_parallel
        if group == "tp":
            return [[i * w + t for t in range(w)] for i in range(d)]
        if group == "dp":
            return [[i * w + t for i in range(d)] for t in range(w)]
        if group == "world":
            return [list(range(w * d))]
        if group == "kv_replicas":
            r = self.cfg.kv_replicas
            return [list(range(i, i + r)) for i in range(0, w * d, r)]
        if group == "self":
            return [[i] for i in range(w * d)]
        raise ValueError(f"group must be 'tp', 'dp', 'world', 'kv_replicas' or 'self' "
                         f"(got {group!r})")

    def position(self, entry: int, group: str = "tp") -> int:
        """Entry ``entry``'s rank inside its group of ``group``."""
        return next(m.index(entry) for m in self.groups(group) if entry in m)

    def group_sum(self, t: torch.Tensor, group: str = "tp") -> torch.Tensor:
        """Every entry of ``t`` ``[R, ...]`` replaced by the sum over its group, in group order
        (one group: ``rank_sum(t)`` on every entry, bit for bit)."""
        out = [None] * t.shape[0]
        for members in self.groups(group):
            total = rank_sum(t[members])[0]
            for m in members:
                out[m] = total
        return torch.stack(out)

    def group_cat(self, t: torch.Tensor, dim: int, group: str = "tp") -> torch.Tensor:
        """Every entry of ``t`` ``[R, ...]`` replaced by its group's entries concatenated along
        ``dim`` of an entry (group order)."""
        out = [None] * t.shape[0]
        for members in self.groups(group):
            full = torch.cat([t[m] for m in members], dim=dim)
            for m in members:
                out[m] = full
        return torch.stack(out)

    def record(self, phase: str, label: str, collective: str = "all_reduce",
               group: str = "tp", op: str | None = "sum") -> None:
        """Append one entry to the ledger (if there is one)."""
        if self.ledger is not None:
            self.ledger.append({"collective": collective, "phase": phase, "group": group,
                                "label": label, "op": op})

    def _apply(self, t, forward_fn, backward_fn, backward_entry=None):
        def backward(grad):
            if backward_entry is not None:
                self.record("backward", *backward_entry)
            return backward_fn(grad)
        return _Collective.apply(t, forward_fn, backward)

    def copy_to_ranks(self, n: torch.Tensor, label: str = F_LABEL,
                      op: str = "sum") -> torch.Tensor:
        """f on ``n`` ``[R, S, B, hidden]``: identity; backward every rank gets the rank sum
        (``op="avg"``: the sum / W, an all-reduce with op AVG)."""
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg' (got {op!r})")
        w = self.world_size if op == "avg" else 1  # x / 1 is x, bit for bit
        if self.f is not None:
            out = torch.stack(self.f.apply(*n.unbind(0)))

            def on_backward(grad):
                self.record("backward", label, op=op)
                return grad / w
            if out.requires_grad:
                out.register_hook(on_backward)
            return out
        return self._apply(n, lambda t: t.view_as(t),
                           lambda g: (self.group_sum(g) / w).contiguous(),
                           (label, "all_reduce", "tp", op))

    def reduce_output(self, partial: torch.Tensor, label: str = G_LABEL) -> torch.Tensor:
        """g on ``partial`` ``[R, S, B, hidden]``: every rank gets the rank sum; backward
        identity."""
        self.record("forward", label)
        if self.g is not None:
            return torch.stack(self.g.apply(*partial.unbind(0)))
        return self._apply(partial, lambda t: self.group_sum(t).contiguous(),
                           lambda g: g)

    def own_tokens(self, full: torch.Tensor, group: str = "tp") -> torch.Tensor:
        """Each rank's ``S/W`` tokens of its own ``[R, S, ...]`` entry: ``[R, S/W, ...]``
        (chunk = the rank's position in its group of ``group``: its TP rank for ``"tp"``)."""
        w = self.world_size
        pos = self.ranks if group == "tp" else [self.position(i, group)
                                                for i in range(full.shape[0])]
        return torch.stack([full[i].chunk(w, dim=0)[r] for i, r in enumerate(pos)])

    def scatter_sum(self, t: torch.Tensor, group: str = "tp") -> torch.Tensor:
        """A reduce-scatter along the sequence: each rank's ``S/W`` tokens (its position in
        its group of ``group``) of its group's sum of ``t`` ``[R, S, ...]``."""
        return self.own_tokens(self.group_sum(t, group), group).contiguous()

    def gather_sequence(self, n: torch.Tensor, reduce_grad: bool = True,
                        group: str = "tp") -> torch.Tensor:
        """SP's f on ``n`` ``[R, S/W, B, hidden]`` -> ``[R, S, B, hidden]`` (every rank's
        tokens in rank order). Backward: a reduce-scatter (rank r's tokens of the rank sum);
        ``reduce_grad=False``: rank r's tokens of its own gradient. ``group``: the group both
        run over (``"dp"``: the other mesh dimension's, of the same size when ``data_parallel
        == world_size``: the shapes are right, the tokens another replica's)."""
        self.record("forward", "all-gather of n along the sequence", "all_gather", group,
                    op=None)

        def forward(t):
            return self.group_cat(t, 0, group).contiguous()

        def backward(g):
            if reduce_grad:
                self.record("backward", "reduce-scatter of dn", "reduce_scatter", group)
                return self.scatter_sum(g, group)
            return self.own_tokens(g, group).contiguous()
        return _Collective.apply(n, forward, backward)

    def reduce_scatter_sequence(self, partial: torch.Tensor) -> torch.Tensor:
        """SP's g on ``partial`` ``[R, S, B, hidden]`` -> ``[R, S/W, B, hidden]`` (rank r's
        tokens of the rank sum). Backward: an all-gather of ``dy``."""
        self.record("forward", "reduce-scatter of output partials", "reduce_scatter")

        def backward(g):
            self.record("backward", "all-gather of dy", "all_gather", op=None)
            return self.group_cat(g, 0).contiguous()
        return _Collective.apply(partial, self.scatter_sum, backward)

    def gather_kv(self, local: torch.Tensor) -> torch.Tensor:
        """K/V all-gather on ``local`` ``[R, S, B, c]`` -> ``[R, S, B, W*c]`` (rank order on
        the last dim). Backward: reduce-scatter, rank r gets chunk r of the rank sum."""
        self.record("forward", "all-gather of K/V activations", "all_gather", op=None)
        c = local.shape[-1]

        def forward(t):
            return self.group_cat(t, -1).contiguous()

        def backward(g):  # rank r's chunk r of the last dim of the rank sum
            self.record("backward", "reduce-scatter of K/V activation grads",
                        "reduce_scatter")
            return self.scatter_sum(g.movedim(-1, 1)).movedim(1, -1).contiguous()
        return _Collective.apply(local, forward, backward)

    def reduce_replica_grads(self, wk: torch.Tensor, wv: torch.Tensor):
        """``(wk, wv)`` ``[R, rows, hidden]`` unchanged; backward every rank gets the sum of
        its KV replica group's gradients (rank order)."""
        def reduce(gk, gv):  # one collective of both, concatenated
            self.record("backward", "all-reduce of wk/wv grads in the replica group",
                        group="kv_replicas")
            total = self.group_sum(torch.cat([gk, gv], dim=1), "kv_replicas")
            return total[:, :gk.shape[1]].contiguous(), total[:, gk.shape[1]:].contiguous()
        return _ReplicaReduce.apply(wk, wv, reduce)

    def reduce_norm_grad(self, grad: torch.Tensor, how: str = "sum") -> torch.Tensor:
        """SP's ``norm`` gradient after backward, ``grad`` ``[R, hidden]``: ``"sum"`` every
        rank gets the rank sum, ``"mean"`` the sum / W, ``"none"`` each keeps its own."""
        if how == "none":
            return grad.clone()
        self.record("after backward", "all-reduce of the norm weight's gradient",
                    op="avg" if how == "mean" else "sum")
        total = self.group_sum(grad)
        if how == "mean":
            total = total / self.world_size
        return total.clone()

    def reduce_qk_norm_grads(self, gq: torch.Tensor, gk: torch.Tensor):
        """The q/k-norm weights' gradients ``[R, head_dim]`` each after backward: every rank
        gets its TP group's sum of both (one all-reduce of the two, concatenated)."""
        self.record("after backward", QK_NORM_GRAD_LABEL)
        both = torch.cat([gq, gk], dim=1)
        total = self.group_sum(both).clone()
        return total[:, :gq.shape[1]].clone(), total[:, gq.shape[1]:].clone()

    def reduce_scalar(self, value: torch.Tensor, label: str) -> torch.Tensor:
        """The sum over ranks of ``value`` ``[R]`` (a step-phase all-reduce over the TP group):
        a scalar; on a TP x DP mesh ``[R]``, each entry its TP group's sum."""
        self.record("step", label)
        total = self.group_sum(value.reshape(value.shape[0], -1))[:, 0]
        return total[0] if self.data_parallel == 1 else total

    def reduce_dp_grads(self, grads: dict[str, torch.Tensor],
                        group: str = "dp") -> dict[str, torch.Tensor]:
        """The data-parallel gradient all-reduce after backward (one flat buffer, SUM):
        ``grads`` by name ``[R, ...]``; every entry gets the sum over its DP group
        (``group="dp"``), or, over a group of one rank (``"self"``), keeps its own: recorded
        with group ``"self"``, a silent no-op."""
        if group not in ("dp", "self"):
            raise ValueError(f"group must be 'dp' or 'self' (got {group!r})")
        self.record("after backward", DP_GRAD_LABEL, group=group)
        return {k: self.group_sum(g, group) for k, g in grads.items()}

    def replica_share(self, share: torch.Tensor) -> torch.Tensor:
        """Under sequence parallelism on a mesh: every rank's share ``[R]`` of its own tokens
        summed over its TP group (a step-phase all-reduce): the replica's share, ``[R]``."""
        self.record("step", SP_SHARE_LABEL)
        return self.group_sum(share.reshape(-1, 1))[:, 0]

    def reduce_loss(self, share: torch.Tensor, group: str = "dp") -> torch.Tensor:
        """The logged loss from every rank's share of the global mean ``share`` ``[R]``: the
        all-reduce SUM over ``group`` (``"dp"``: the true loss; ``"world"``: every rank of the
        mesh, ``world_size`` times it); ``"tp"``: the loss a Replicate DTensor on the TP mesh
        reports with ``full_tensor()``, no collective at all (each replica its own share)."""
        if group not in ("dp", "world", "tp"):
            raise ValueError(f"group must be 'dp', 'world' or 'tp' (got {group!r})")
        if group == "tp":
            return share.clone()
        self.record("step", LOSS_LABEL, group=group)
        return self.group_sum(share.reshape(-1, 1), group)[:, 0]
