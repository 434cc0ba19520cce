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

``SimulatedRanks`` holds every rank (``R = world_size``): each collective is a sum or a
concatenation over dim 0, in rank order (``t[0] + t[1] + ...``, as the all-reduces of a ring of
real ranks are modelled elsewhere in the package). A ``ledger`` list, when given, records every
collective as ``{"collective", "phase", "group", "label", "op"}`` when it runs (backward
ones during backward; ``op``: the reduction the program asked for, ``"sum"`` or ``"avg"``,
``None`` for a gather). ``f`` and ``g`` may be replaced by a reader's own ``torch.autograd.Function``
subclasses whose ``apply(*tensors)`` maps one tensor per rank to one per rank (the exercises'
contract). ``tpattn.real.ranks.DistributedRanks`` has the same methods for one real
torch.distributed rank (``R = 1``; its ``CollectiveLedger`` records the collectives).
"""
from __future__ import annotations

import torch

from tpattn.config import Config

__all__ = ["SimulatedRanks", "rank_sum", "F_LABEL", "G_LABEL"]

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


class SimulatedRanks:
    """Every rank of ``cfg.world_size`` in one process, as dim 0 of every tensor.

    ``ledger``: a list to record the collectives in (``None``: record nothing). ``f``, ``g``:
    optional ``torch.autograd.Function`` subclasses with ``apply(*tensors)`` (one ``[...]``
    per rank in, one per rank out) used in place of f and g.
    """

    def __init__(self, cfg: Config, ledger: list | None = None, f=None, g=None):
        self.cfg, self.ledger, self.f, self.g = cfg, ledger, f, g
        self.world_size = cfg.world_size
        #: The global rank of each entry of dim 0.
        self.ranks = list(range(cfg.world_size))

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
                           lambda g: (rank_sum(g) / w).expand_as(g).contiguous(),
                           (label, "all_reduce", "tp", op))

    def reduce_output(self, partial: torch.Tensor, label: str = G_LABEL) -> torch.Tensor:
        """g on ``partial`` ``[R, S, B, hidden]``: every rank gets the rank sum; backward
        identity."""
        self.record("forward", label)
        if self.g is not None:
            return torch.stack(self.g.apply(*partial.unbind(0)))
        return self._apply(partial, lambda t: rank_sum(t).expand_as(t).contiguous(),
                           lambda g: g)

    def own_tokens(self, full: torch.Tensor) -> torch.Tensor:
        """Each rank's ``S/W`` tokens of its own ``[R, S, ...]`` entry: ``[R, S/W, ...]``."""
        w = self.world_size
        return torch.stack([full[i].chunk(w, dim=0)[r] for i, r in enumerate(self.ranks)])

    def gather_sequence(self, n: torch.Tensor, reduce_grad: bool = True) -> torch.Tensor:
        """SP's f on ``n`` ``[R, S/W, B, hidden]`` -> ``[R, S, B, hidden]`` (every rank's
        tokens in rank order). Backward: a reduce-scatter (rank r's tokens of the rank sum);
        ``reduce_grad=False``: rank r's tokens of its own gradient."""
        self.record("forward", "all-gather of n along the sequence", "all_gather", op=None)

        def forward(t):
            full = torch.cat(t.unbind(0), dim=0)
            return full.unsqueeze(0).expand(t.shape[0], *full.shape).contiguous()

        def backward(g):
            if reduce_grad:
                self.record("backward", "reduce-scatter of dn", "reduce_scatter")
                g = rank_sum(g).expand_as(g)
            return self.own_tokens(g).contiguous()
        return _Collective.apply(n, forward, backward)

    def reduce_scatter_sequence(self, partial: torch.Tensor) -> torch.Tensor:
        """SP's g on ``partial`` ``[R, S, B, hidden]`` -> ``[R, S/W, B, hidden]`` (rank r's
        tokens of the rank sum). Backward: an all-gather of ``dy``."""
        self.record("forward", "reduce-scatter of output partials", "reduce_scatter")

        def backward(g):
            self.record("backward", "all-gather of dy", "all_gather", op=None)
            full = torch.cat(g.unbind(0), dim=0)
            return full.unsqueeze(0).expand(g.shape[0], *full.shape).contiguous()
        return _Collective.apply(
            partial, lambda t: self.own_tokens(rank_sum(t).expand_as(t)).contiguous(),
            backward)

    def gather_kv(self, local: torch.Tensor) -> torch.Tensor:
        """K/V all-gather on ``local`` ``[R, S, B, c]`` -> ``[R, S, B, W*c]`` (rank order on
        the last dim). Backward: reduce-scatter, rank r gets chunk r of the rank sum."""
        self.record("forward", "all-gather of K/V activations", "all_gather", op=None)
        c = local.shape[-1]

        def forward(t):
            full = torch.cat(t.unbind(0), dim=-1)
            return full.unsqueeze(0).expand(t.shape[0], *full.shape).contiguous()

        def backward(g):
            self.record("backward", "reduce-scatter of K/V activation grads",
                        "reduce_scatter")
            total = rank_sum(g)[0]
            return torch.stack([total[..., r * c:(r + 1) * c] for r in self.ranks])
        return _Collective.apply(local, forward, backward)

    def reduce_replica_grads(self, wk: torch.Tensor, wv: torch.Tensor):
        """``(wk, wv)`` ``[R, rows, hidden]`` unchanged; backward every rank gets the sum of
        its KV replica group's gradients (rank order)."""
        r = self.cfg.kv_replicas

        def group_sum(g):
            groups = g.view(-1, r, *g.shape[1:])
            total = groups[:, 0]
            for i in range(1, r):
                total = total + groups[:, i]
            return total.unsqueeze(1).expand_as(groups).reshape(g.shape).contiguous()

        def reduce(gk, gv):
            self.record("backward", "all-reduce of wk/wv grads in the replica group",
                        group="kv_replicas")
            return group_sum(gk), group_sum(gv)
        return _ReplicaReduce.apply(wk, wv, reduce)

    def reduce_norm_grad(self, grad: torch.Tensor, how: str = "sum") -> torch.Tensor:
        """SP's ``norm`` gradient after backward, ``grad`` ``[R, hidden]``: ``"sum"`` every
        rank gets the rank sum, ``"mean"`` the sum / W, ``"none"`` each keeps its own."""
        if how == "none":
            return grad.clone()
        self.record("after backward", "all-reduce of the norm weight's gradient",
                    op="avg" if how == "mean" else "sum")
        total = rank_sum(grad)
        if how == "mean":
            total = total / self.world_size
        return total.expand_as(grad).clone()

    def reduce_qk_norm_grads(self, gq: torch.Tensor, gk: torch.Tensor):
        """The q/k-norm weights' gradients ``[R, head_dim]`` each after backward: every rank
        gets the rank sum of both (one all-reduce of the two, concatenated)."""
        self.record("after backward", QK_NORM_GRAD_LABEL)
        both = torch.cat([gq, gk], dim=1)
        total = rank_sum(both).expand_as(both).clone()
        return total[:, :gq.shape[1]].clone(), total[:, gq.shape[1]:].clone()

    def reduce_scalar(self, value: torch.Tensor, label: str) -> torch.Tensor:
        """The sum over ranks of ``value`` ``[R]`` (a step-phase all-reduce): a scalar."""
        self.record("step", label)
        return rank_sum(value.reshape(value.shape[0], -1))[0, 0]
