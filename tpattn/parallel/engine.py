"""The sharded attention block, written once, for the ranks one process holds.

Every tensor carries a leading local-rank dimension ``R`` (``R = world_size`` for
``collectives.SimulatedRanks``, ``R = 1`` for one real rank's
``tpattn.real.ranks.DistributedRanks``): rank r's entry is exactly what rank r holds::

    x    [R, S_r, B, hidden]    S_r = S/W under sequence parallelism, else S
    norm [R, hidden]    wq [R, Hq/W*D, hidden]    wk, wv [R, rows, hidden]
    wo   [R, hidden, Hq/W*D]    bias [R, hidden] (optional)

``rank_block(x, p, cfg, inj, comm)`` is the block; ``comm`` supplies the collectives (see
``tpattn.parallel.collectives``) and ``inj`` (``tpattn.bugs.zoo.Injection``, or anything with its
fields) says how the program is wired: f's backward (``"sum"``, ``"none"``, ``"mean"``,
``"twice"``), how many g's, the bias, the K/V repeat (``"interleave"``/``"tile"``) and, with
replicated KV heads, whether the replica-group reduce runs (``kv_grad``). ``cfg`` says the
layout: ``sequence_parallel`` (f becomes an all-gather along the sequence, g a
reduce-scatter), ``kv_heads < world_size`` with ``kv_strategy`` (each rank a replica of its KV
head, or the K/V all-gather), ``qk_norm`` (RMSNorm on every query and key head before RoPE,
weights ``q_norm``, ``k_norm`` ``[R, head_dim]`` replicated on every rank) and ``dropout``
(attention dropout on each rank's attention probabilities, masks from its model-parallel
stream; residual dropout on the block's output before the residual add, masks from its
default stream: ``rng``, a ``tpattn.parallel.rng.RankStreams`` for the ranks ``comm``
holds). ``train_step`` is one training step of it; with ``qk_norm`` it all-reduces the
q/k-norm weights' gradients over the TP group after backward (``reduce_qk_norm_grads``, as
Megatron's ``finalize_model_grads`` does for such parameters) unless
``inj.qk_norm_grad == "none"``.

The ranks' heads go through ``layers.attention`` together, rank-major, and each rank's
matmuls are one entry of a batched matmul; digits differ from a loop over ranks at rounding
level (no bit parity promised), while ranks that compute on equal numbers get equal bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpattn.config import KV_STRATEGIES, Config
from tpattn.block.layers import apply_rope, attention, repeat_kv, rms_norm
from tpattn.block.sgd import sgd_step
from .collectives import G_LABEL, QK_NORM_GRAD_LABEL

__all__ = ["rank_block", "train_step", "stack_ranks", "unstack_ranks", "REPLICATED",
           "GRAD_NORM_LABEL", "MAX_GRAD_NORM", "ScaleGrad", "reduce_qk_norm_grads",
           "QK_NORM_GRAD_LABEL", "head_norm", "mesh_sync"]

#: Parameters every rank holds whole (counted once in the gradient norm).
REPLICATED = ("norm", "bias", "q_norm", "k_norm")

#: Ledger label of the gradient norm's all-reduce.
GRAD_NORM_LABEL = "sum of squared gradient norms"
#: Gradient clipping threshold of the modes that clip.
MAX_GRAD_NORM = 0.25


def stack_ranks(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-rank dicts of tensors -> one dict of ``[R, ...]`` tensors (detached copies)."""
    return {k: torch.stack([d[k].detach() for d in per_rank]) for k in per_rank[0]}


def unstack_ranks(stacked: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """``stack_ranks``'s inverse: rank r's dict of views ``t[r]``."""
    r = next(iter(stacked.values())).shape[0]
    return [{k: t[i] for k, t in stacked.items()} for i in range(r)]


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale`` (``apply(t, scale)``:
    a gradient averaged, or multiplied, where it should be summed once)."""

    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _heads(t: torch.Tensor, d: int) -> torch.Tensor:
    """``[R, S, B, H*D]`` -> ``[S, B, R*H, D]``: every rank's heads, rank-major."""
    r, s, b = t.shape[:3]
    return t.view(r, s, b, -1, d).permute(1, 2, 0, 3, 4).reshape(s, b, -1, d)


def _project(n: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each rank's ``F.linear``: n ``[R, S, B, in]``, w ``[R, out, in]`` -> ``[R, S, B, out]``."""
    r, s, b, _ = n.shape
    return torch.bmm(n.reshape(r, s * b, -1), w.transpose(1, 2)).view(r, s, b, -1)


def head_norm(t: torch.Tensor, w: torch.Tensor, cfg: Config) -> torch.Tensor:
    """qk-norm of every rank's heads: t ``[S, B, R*H, D]`` (rank-major), w each rank's
    weight ``[R, D]``: RMSNorm over ``D`` with rank r's weight on rank r's heads."""
    return rms_norm(t, w.repeat_interleave(t.shape[2] // w.shape[0], dim=0), cfg.eps)


def _attend(n: torch.Tensor, p: dict, cfg: Config, inj, comm, rng=None) -> torch.Tensor:
    """Every rank's attention and its columns of wo: n ``[R, S, B, hidden]`` (the whole
    sequence) -> the partials ``[R, S, B, hidden]``."""
    r, s, b, _ = n.shape
    d = cfg.head_dim
    if cfg.qk_norm:  # RMSNorm on every query head, then RoPE (Qwen3's order)
        q = apply_rope(head_norm(_heads(_project(n, p["wq"]), d), p["q_norm"], cfg))
    else:
        q = apply_rope(_heads(_project(n, p["wq"]), d))
    wk, wv = p["wk"], p["wv"]
    gathered = cfg.kv_heads < cfg.world_size and cfg.kv_strategy == KV_STRATEGIES[1]
    if gathered:  # every rank's slice of K/V, all-gathered; each rank picks its KV head
        local = torch.cat([_project(n, wk), _project(n, wv)], dim=-1)
        parts = comm.gather_kv(local).view(r, s, b, cfg.world_size, 2, -1)
        heads = torch.tensor([rank // cfg.kv_replicas for rank in comm.ranks])
        k_all = parts[:, :, :, :, 0].reshape(r, s, b, cfg.kv_heads, d)
        v_all = parts[:, :, :, :, 1].reshape(r, s, b, cfg.kv_heads, d)
        idx = torch.arange(r)
        k = k_all[idx, :, :, heads].reshape(r, s, b, d)
        v = v_all[idx, :, :, heads].reshape(r, s, b, d)
    else:
        if cfg.kv_heads < cfg.world_size and inj.kv_grad == "sum" and cfg.kv_replicas > 1:
            wk, wv = comm.reduce_replica_grads(wk, wv)
        k, v = _project(n, wk), _project(n, wv)
    k, v = _heads(k, d), _heads(v, d)
    k = apply_rope(head_norm(k, p["k_norm"], cfg) if cfg.qk_norm else k)
    groups = q.shape[2] // k.shape[2]
    if inj.kv == "tile":  # each rank tiles its own block of KV heads
        k, v = (t.view(s, b, r, -1, d).repeat(1, 1, 1, groups, 1).reshape(s, b, -1, d)
                for t in (k, v))
    else:  # rank-major heads: the global repeat_interleave is every rank's own
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    drop = rng.attention_masks(cfg) if cfg.dropout > 0 else None  # [B, R*H, S, S]
    ctx = attention(q, k, v, drop).reshape(s, b, r, -1).permute(2, 0, 1, 3)
    return _project(ctx.contiguous(), p["wo"])


def rank_block(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config, inj,
               comm, rng=None) -> torch.Tensor:
    """The block on the ranks ``comm`` holds: x ``[R, S_r, B, hidden]``, ``p`` their
    parameters (module docstring); returns every rank's output ``[R, S_r, B, hidden]``.
    ``rng``: the ranks' random streams (``tpattn.parallel.rng.RankStreams``), needed when
    ``cfg.dropout > 0`` (each call draws new masks)."""
    if cfg.dropout > 0 and rng is None:
        raise ValueError(f"rng must be the ranks' random streams (tpattn.parallel.rng."
                         f"RankStreams) when dropout > 0 (got dropout={cfg.dropout})")
    n = rms_norm(x, p["norm"].unsqueeze(1).unsqueeze(1), cfg.eps)
    if cfg.sequence_parallel:  # f is the all-gather along the sequence (over sp_group)
        over = {} if inj.sp_group == "tp" else {"group": inj.sp_group}
        n = comm.gather_sequence(n, reduce_grad=inj.f != "none", **over)
    elif inj.f != "none":  # f = "mean" is an all-reduce with op AVG
        n = comm.copy_to_ranks(n, op="avg" if inj.f == "mean" else "sum")
        if inj.f == "twice":
            n = comm.copy_to_ranks(n, "all-reduce of dn (again)")
    if inj.f == "mean" and cfg.sequence_parallel:
        n = ScaleGrad.apply(n, 1.0 / cfg.world_size)
    out = _attend(n, p, cfg, inj, comm, rng)
    if inj.partial_scale != 1.0:  # a factor for every rank, or one per rank (a tuple)
        scale = inj.partial_scale
        out = out * (out.new_tensor([scale[r] for r in comm.ranks]).view(-1, 1, 1, 1)
                     if isinstance(scale, tuple) else scale)
    if inj.bias == "every_rank":
        out = out + p["bias"].unsqueeze(1).unsqueeze(1)
    if cfg.sequence_parallel:  # g is the reduce-scatter; without it, each its own tokens
        out = comm.reduce_scatter_sequence(out) if inj.g else comm.own_tokens(out)
    else:
        for i in range(inj.g):
            out = comm.reduce_output(out, G_LABEL + (" (again)" if i else ""))
    if cfg.dropout > 0:  # residual dropout, outside the sharded region: the default stream
        out = out * rng.residual_masks(cfg)
    if inj.bias == "after_g":
        out = out + p["bias"].unsqueeze(1).unsqueeze(1)
    return x + out


def reduce_qk_norm_grads(grads: dict[str, torch.Tensor], cfg: Config, inj, comm) -> None:
    """With ``cfg.qk_norm``, after backward: every rank's ``q_norm``/``k_norm`` gradient
    ``[R, head_dim]`` (its own heads' part) all-reduced over the TP group in one collective
    (``comm.reduce_qk_norm_grads``), in place in ``grads``; skipped under
    ``inj.qk_norm_grad == "none"`` (each rank keeps its partial)."""
    if cfg.qk_norm and inj.qk_norm_grad == "sum":
        grads["q_norm"], grads["k_norm"] = comm.reduce_qk_norm_grads(grads["q_norm"],
                                                                     grads["k_norm"])


def train_step(p: dict[str, torch.Tensor], x: torch.Tensor, target: torch.Tensor,
               cfg: Config, inj, comm, lr: float, rng=None) -> dict:
    """One step on the ranks ``comm`` holds: forward, every rank's loss, backward, the norm
    gradient's reduce (sequence parallel), the q/k-norm gradients' reduce (``qk_norm``), the
    logged gradient norm, clipping if on, SGD. ``rng``: the ranks' random streams
    (``rank_block``; needed when ``cfg.dropout > 0``).

    p: stacked parameters (not modified); x, target ``[R, S_r, B, hidden]``. Rank r's loss is
    its MSE, or under sequence parallelism its share of the global MSE (``sum / numel``:
    ``losses`` then holds the global MSE on every rank). On a TP x DP mesh
    (``cfg.data_parallel > 1``, ``R = cfg.ranks``) its share of the global mean, and after
    backward ``mesh_sync``: the DP gradient all-reduce and the logged loss. Returns
    ``outputs``, ``losses`` ``[R]``, ``input_grads``, ``grads`` and ``weights`` (stacked
    dicts), ``grad_norm`` (float) and ``ledger`` (``comm.ledger``).
    """
    r = x.shape[0]
    ps = {k: t.detach().clone().requires_grad_(True) for k, t in p.items()}
    xs = x.detach().clone().requires_grad_(True)
    y = rank_block(xs, ps, cfg, inj, comm, rng)
    sq = (y - target).pow(2)
    if cfg.data_parallel > 1:  # a TP x DP mesh: each rank's share of the global mean
        losses = sq.flatten(1).sum(1).div(cfg.seq * cfg.batch * cfg.data_parallel * cfg.hidden)
        losses.sum().backward()
    elif cfg.sequence_parallel:
        numel = target.numel() * cfg.world_size // r
        sq.flatten(1).sum(1).div(numel).sum().backward()
        losses = F.mse_loss(y.detach(), target, reduction="sum").div(numel).expand(r)
    else:
        losses = sq.mean(dim=(1, 2, 3))
        losses.sum().backward()
    grads = {k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in ps.items()}
    if cfg.sequence_parallel:
        grads["norm"] = comm.reduce_norm_grad(grads["norm"], inj.norm_grad)
    reduce_qk_norm_grads(grads, cfg, inj, comm)
    if cfg.data_parallel > 1:  # the DP gradient all-reduce, then the logged loss
        grads, losses = mesh_sync(losses, grads, cfg, inj, comm)
    squares = 0.0
    for name, g in grads.items():  # replicated ones on rank 0 only unless norm="per_rank"
        s = g.double().pow(2).flatten(1).sum(1)
        if name in REPLICATED and inj.norm == "once":
            s = s * (torch.tensor(comm.ranks) == 0)
        squares = squares + s
    norm = comm.reduce_scalar(torch.as_tensor(squares), GRAD_NORM_LABEL).sqrt()
    norms = norm.reshape(-1).expand(r)  # each rank its TP group's (one value on plain TP)
    coefs = [min(1.0, MAX_GRAD_NORM / (float(n) + 1e-6)) if inj.clip else 1.0 for n in norms]
    scales = inj.rank_lr_scale or (1.0,) * cfg.world_size
    per_rank = [sgd_step({k: t[i] for k, t in ps.items()}, {k: g[i] for k, g in grads.items()},
                         lr, scales[rank] * coefs[i]) for i, rank in enumerate(comm.ranks)]
    weights = {k: torch.stack([w[k] for w in per_rank]) for k in ps}
    return {"outputs": y.detach(), "losses": losses.detach(), "input_grads": xs.grad,
            "grads": grads, "weights": weights, "grad_norm": float(norms[0]),
            "ledger": comm.ledger}


def mesh_sync(shares: torch.Tensor, grads: dict[str, torch.Tensor], cfg: Config, inj,
              comm) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """After backward on a TP x DP mesh (``cfg.data_parallel > 1``): the DP gradient
    all-reduce over ``inj.dp_grad``'s group (``comm.reduce_dp_grads``), then the logged loss:
    every rank's share of its replica ``shares`` ``[R]`` (under sequence parallelism the TP
    group's shares summed, ``comm.replica_share``) all-reduced over ``inj.loss_group``
    (``comm.reduce_loss``). Returns the synced ``grads`` and every rank's logged loss
    ``[R]``."""
    grads = comm.reduce_dp_grads(grads, inj.dp_grad)
    share = shares.detach()
    if cfg.sequence_parallel:  # the replica's share on each of its TP ranks
        share = comm.replica_share(share)
    return grads, comm.reduce_loss(share, inj.loss_group).reshape(shares.shape[0])
