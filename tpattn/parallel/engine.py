"""The sharded attention block, written once, for the ranks one process holds. Every tensor
has a leading rank dim ``R``: x ``[R, S_r, B, hidden]`` (``S_r = S/W`` under SP), wq
``[R, Hq/W*D, hidden]``, wk, wv ``[R, rows, hidden]``, wo ``[R, hidden, Hq/W*D]``, norm, bias
``[R, hidden]``, q_norm, k_norm ``[R, D]``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpattn.config import KV_STRATEGIES, Config
from tpattn.block.layers import apply_rope, attention, rms_norm
from .collectives import reduce_scalar, replica_share
from .program import CORRECT, REPLICATED, Program

__all__ = ["rank_block", "train_step", "stack_ranks", "unstack_ranks", "REPLICATED", "grad_norm",
           "GRAD_NORM_LABEL", "MAX_GRAD_NORM", "head_norm", "mesh_sync", "as_program", "attend"]

GRAD_NORM_LABEL = "sum of squared gradient norms"
#: Gradient clipping threshold of the modes that clip.
MAX_GRAD_NORM = 0.25


def as_program(prog) -> Program:
    """``prog`` if it is a ``Program``, else its ``program()`` (an ``Injection``)."""
    return prog if isinstance(prog, Program) else prog.program()


def stack_ranks(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-rank dicts -> one dict of ``[R, ...]`` tensors (detached copies)."""
    return {k: torch.stack([d[k].detach() for d in per_rank]) for k in per_rank[0]}


def unstack_ranks(stacked: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """``stack_ranks``'s inverse: rank r's dict of views ``t[r]``."""
    r = next(iter(stacked.values())).shape[0]
    return [{k: t[i] for k, t in stacked.items()} for i in range(r)]


def _heads(t: torch.Tensor, d: int) -> torch.Tensor:
    """``[R, S, B, H*D]`` -> ``[S, B, R*H, D]``: every rank's heads, rank-major."""
    r, s, b = t.shape[:3]
    return t.view(r, s, b, -1, d).permute(1, 2, 0, 3, 4).reshape(s, b, -1, d)


def _project(n: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each rank's ``F.linear``: n ``[R, S, B, in]``, w ``[R, out, in]`` -> ``[R, S, B, out]``."""
    r, s, b, _ = n.shape
    return torch.bmm(n.reshape(r, s * b, -1), w.transpose(1, 2)).view(r, s, b, -1)


def head_norm(t: torch.Tensor, w: torch.Tensor, cfg: Config) -> torch.Tensor:
    """RMSNorm over ``D`` of every rank's heads t ``[S, B, R*H, D]`` (rank-major), rank r's
    weight ``w[r]`` ``[D]`` on rank r's heads."""
    return rms_norm(t, w.repeat_interleave(t.shape[2] // w.shape[0], dim=0), cfg.eps)


def _kv(n: torch.Tensor, p: dict, cfg: Config, comm, prog: Program):
    """Every rank's K and V ``[R, S, B, Hkv_r*D]`` (``gather_activations``: all-gathered)."""
    r, s, b, _ = n.shape
    if cfg.kv_heads < cfg.world_size and cfg.kv_strategy == KV_STRATEGIES[1]:
        local = torch.cat([_project(n, p["wk"]), _project(n, p["wv"])], dim=-1)
        parts = prog.kv_gather(local, comm).view(r, s, b, cfg.world_size, 2, -1)
        heads = torch.tensor([rank // cfg.kv_replicas for rank in comm.ranks])
        idx = torch.arange(r)
        return tuple(parts[:, :, :, :, i].reshape(r, s, b, cfg.kv_heads, -1)[idx, :, :, heads]
                     .reshape(r, s, b, -1) for i in (0, 1))
    wk, wv = p["wk"], p["wv"]
    if cfg.kv_replicas > 1:
        wk, wv = prog.replica_reduce(wk, wv, comm)
    return _project(n, wk), _project(n, wv)


def attend(n: torch.Tensor, p: dict, cfg: Config, comm, prog: Program = CORRECT,
           rng=None) -> torch.Tensor:
    """Every rank's attention and wo columns: n ``[R, S, B, hidden]`` -> partials."""
    r, s, b, _ = n.shape
    d = cfg.head_dim
    q = _heads(_project(n, p["wq"]), d)
    k, v = (_heads(t, d) for t in _kv(n, p, cfg, comm, prog))
    if cfg.qk_norm:  # RMSNorm on every query and key head, then RoPE (Qwen3's order)
        q, k = head_norm(q, p["q_norm"], cfg), head_norm(k, p["k_norm"], cfg)
    q, k = apply_rope(q), apply_rope(k)
    groups = q.shape[2] // k.shape[2]
    k, v = prog.repeat_kv(k, groups, r), prog.repeat_kv(v, groups, r)
    drop = rng.attention_masks(cfg) if cfg.dropout > 0 else None  # [B, R*H, S, S]
    ctx = attention(q, k, v, drop).reshape(s, b, r, -1).permute(2, 0, 1, 3)
    return _project(ctx.contiguous(), p["wo"])


def rank_block(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config, prog,
               comm, rng=None) -> torch.Tensor:
    """The block on ``comm``'s ranks: x ``[R, S_r, B, hidden]`` -> ``[R, S_r, B, hidden]``.
    ``prog``: a ``Program`` or ``Injection``; ``rng``: ``RankStreams`` (dropout > 0)."""
    if cfg.dropout > 0 and rng is None:
        raise ValueError(f"rng must be the ranks' random streams (tpattn.parallel.rng."
                         f"RankStreams) when dropout > 0 (got dropout={cfg.dropout})")
    prog = as_program(prog)
    n = rms_norm(x, p["norm"].unsqueeze(1).unsqueeze(1), cfg.eps)  # replicated norm
    if cfg.sequence_parallel:  # f: all-gather along the sequence
        n = prog.sp_gather(n, comm)
    else:  # f: identity, backward all-reduce of dn
        n = prog.f(n, comm)
    partials = prog.before_g(attend(n, p, cfg, comm, prog, rng), p, comm)
    if cfg.sequence_parallel:  # g: reduce-scatter along the sequence
        out = prog.sp_scatter(partials, comm)
    else:  # g: all-reduce of the partials
        out = prog.g(partials, comm)
    if cfg.dropout > 0:  # residual dropout, outside the sharded region: the default stream
        out = out * rng.residual_masks(cfg)
    return x + prog.add_bias(out, p)


def _losses(y: torch.Tensor, target: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Backward of every rank's loss; the losses ``[R]``: its MSE (SP: the global MSE; on a
    mesh: its share of the global mean)."""
    r = y.shape[0]
    sq = (y - target).pow(2)
    if cfg.data_parallel > 1:
        losses = sq.flatten(1).sum(1).div(cfg.seq * cfg.batch * cfg.data_parallel * cfg.hidden)
        losses.sum().backward()
    elif cfg.sequence_parallel:
        numel = target.numel() * cfg.world_size // r
        sq.flatten(1).sum(1).div(numel).sum().backward()
        losses = F.mse_loss(y.detach(), target, reduction="sum").div(numel).expand(r)
    else:
        losses = sq.mean(dim=(1, 2, 3))
        losses.sum().backward()
    return losses


def train_step(p: dict[str, torch.Tensor], x: torch.Tensor, target: torch.Tensor,
               cfg: Config, prog, comm, lr: float, rng=None) -> dict:
    """One step on ``comm``'s ranks: p stacked, x, target ``[R, S_r, B, hidden]`` ->
    ``outputs``, ``losses``, ``input_grads``, ``grads``, ``weights``, ``grad_norm``, ``ledger``."""
    prog = as_program(prog)
    r = x.shape[0]
    ps = {k: t.detach().clone().requires_grad_(True) for k, t in p.items()}
    xs = x.detach().clone().requires_grad_(True)
    y = rank_block(xs, ps, cfg, prog, comm, rng)
    losses = _losses(y, target, cfg)
    grads = {k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in ps.items()}
    if cfg.sequence_parallel:
        grads["norm"] = prog.norm_grad(grads["norm"], comm)
    if cfg.qk_norm:
        grads["q_norm"], grads["k_norm"] = prog.qk_norm_grads(grads["q_norm"],
                                                              grads["k_norm"], comm)
    if cfg.data_parallel > 1:
        grads, losses = mesh_sync(losses, grads, cfg, prog, comm)
    norms = grad_norm(grads, comm, prog).reshape(-1).expand(r)  # each rank its TP group's
    coefs = [min(1.0, MAX_GRAD_NORM / (float(n) + 1e-6)) if prog.clip else 1.0 for n in norms]
    return {"outputs": y.detach(), "losses": losses.detach(), "input_grads": xs.grad,
            "grads": grads, "weights": prog.update(ps, grads, lr, coefs, comm),
            "grad_norm": float(norms[0]), "ledger": comm.ledger}


def grad_norm(grads: dict[str, torch.Tensor], comm, prog=CORRECT) -> torch.Tensor:
    """The global gradient norm: a scalar (``[R]`` on a mesh)."""
    squares = as_program(prog).grad_squares(grads, comm)
    return reduce_scalar(squares, comm, GRAD_NORM_LABEL).sqrt()


def mesh_sync(shares: torch.Tensor, grads: dict[str, torch.Tensor], cfg: Config, prog,
              comm) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """After backward on a TP x DP mesh: ``prog.dp_grads``, then the logged loss ``[R]`` from
    the shares ``[R]`` (SP: summed over the TP group first) through ``prog.loss``."""
    prog = as_program(prog)
    grads = prog.dp_grads(grads, comm)
    share = shares.detach()
    if cfg.sequence_parallel:  # the replica's share on each of its TP ranks
        share = replica_share(share, comm)
    return grads, prog.loss(share, comm).reshape(shares.shape[0])

