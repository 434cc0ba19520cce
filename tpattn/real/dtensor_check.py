"""Cross-check with PyTorch's own tensor-parallel API (DTensor): ``AttentionBlock`` sharded by
``parallelize_module`` with Megatron's plan (or ``dtensor_sp``'s), PyTorch placing the
collectives."""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tpattn.check.core import (EQUIVALENCE, LR, PARAM_SEED_OFFSET, dense_reference,
                               five_measures, make_inputs)
from tpattn.config import Config
from tpattn.block.layers import apply_rope, attention, repeat_kv, rms_norm
from tpattn.block.params import PARAM_NAMES, init_params
from tpattn.block.sgd import sgd_step_in_place
from tpattn.parallel.sequence_parallel import rank_tokens
from .module_check import full_value

__all__ = ["RMSNorm", "AttentionBlock", "parallelize_block", "dtensor_check", "comm_counts",
           "norm_grad_placement"]


class RMSNorm(nn.Module):
    """``rms_norm`` as a module (``SequenceParallel`` shards a module's input)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class AttentionBlock(nn.Module):
    """``dense_forward`` as a module; head counts, sequence length from the local projections."""

    def __init__(self, params: dict[str, torch.Tensor], cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(params["norm"], cfg.eps)
        for name in ("wq", "wk", "wv", "wo"):
            weight = params[name]  # [out_features, in_features]
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                               device=weight.device, dtype=weight.dtype)
            linear.weight = nn.Parameter(weight.clone())
            setattr(self, name, linear)

    def weights(self) -> dict[str, torch.Tensor]:
        """The block's parameters by ``PARAM_NAMES``."""
        return {"norm": self.norm.weight,
                **{k: getattr(self, k).weight for k in ("wq", "wk", "wv", "wo")}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[S, B, hidden]`` (SP: one rank's ``[S/W, B, hidden]``) -> the same shape."""
        n = self.norm(x)
        q = self.wq(n)  # [S, B, local query heads * D]: the whole sequence, even under SP
        s, b, d = q.shape[0], q.shape[1], self.cfg.head_dim
        q = apply_rope(q.view(s, b, -1, d))  # -1: local query heads; positions 0..S-1
        k = apply_rope(self.wk(n).view(s, b, -1, d))
        v = self.wv(n).view(s, b, -1, d)
        g = self.cfg.group_size
        ctx = attention(q, repeat_kv(k, g), repeat_kv(v, g))
        return x + self.wo(ctx.reshape(s, b, -1))


def parallelize_block(block: AttentionBlock, world_size: int,
                      device_type: str = "cpu") -> AttentionBlock:
    """Shard ``block`` in place over a 1-D device mesh of ``world_size`` ranks (Megatron's plan)."""
    mesh = init_device_mesh(device_type, (world_size,))
    plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
            "wo": RowwiseParallel()}
    return parallelize_module(block, mesh, plan)


def dtensor_check(seed: int, cfg: Config, device: torch.device | str = "cpu",
                  parallelize=parallelize_block) -> tuple[dict, dict]:
    """On every rank: ``run(seed, "equivalence", cfg)``'s measures with the block sharded by
    ``parallelize(block, world_size, device_type)`` (under ``cfg.sequence_parallel`` on this
    rank's tokens ``[S/W, B, hidden]``), and its collectives ``{"<phase> <kind>": n}`` (phases
    forward, backward, SGD step) with ``norm_grad_placement``."""
    device = torch.device(device)
    x0, target = (t.to(device) for t in make_inputs(cfg, seed))
    base = {k: v.to(device) for k, v in init_params(cfg, seed + PARAM_SEED_OFFSET).items()}
    sp = cfg.sequence_parallel
    tokens = rank_tokens(cfg, dist.get_rank()) if sp else slice(None)
    block = parallelize(AttentionBlock(base, cfg), cfg.world_size, device.type)
    x = x0[tokens].clone().requires_grad_(True)
    comms = {phase: CommDebugMode() for phase in ("forward", "backward", "SGD step")}
    with comms["forward"]:
        y = block(x)
    with comms["backward"]:
        loss = F.mse_loss(y, target[tokens], reduction="sum") / target.numel() if sp \
            else F.mse_loss(y, target)
        loss.backward()
    placement = norm_grad_placement(block)
    params = block.weights()
    grads = {k: full_value(params[k].grad) for k in PARAM_NAMES}  # a Partial: summed on reading
    with comms["SGD step"]:
        stepped = sgd_step_in_place(params, {k: p.grad for k, p in params.items()}, LR)
    out, x_grad = y.detach(), x.grad
    if sp:  # every rank's tokens
        parts = [[torch.empty_like(t) for _ in range(cfg.world_size)] for t in (out, x_grad)]
        for part, t in zip(parts, (out, x_grad)):
            dist.all_gather(part, t.contiguous())
        out, x_grad = torch.cat(parts[0]), torch.cat(parts[1])
        loss = F.mse_loss(out, target)
    tp = {"output": out, "loss": loss.detach(), "input_grad": x_grad, "grads": grads,
          "weights": {k: full_value(stepped[k]) for k in PARAM_NAMES}}
    ledger = {k: n for phase, mode in comms.items() for k, n in comm_counts(mode, phase).items()}
    return (five_measures(seed, EQUIVALENCE, dense_reference(x0, target, base, cfg), tp),
            {**ledger, "norm_grad_placement": placement})


def norm_grad_placement(block: AttentionBlock) -> str:
    """How DTensor holds the ``norm`` weight's gradient after backward, e.g. ``"Replicate()"``."""
    grad = block.norm.weight.grad
    return ", ".join(str(p) for p in grad.placements) if hasattr(grad, "placements") else "plain"


def comm_counts(mode: CommDebugMode, phase: str) -> dict[str, int]:
    """``{"<phase> <kind>": n}`` of the all-gathers, reduce-scatters and all-reduces in ``mode``."""
    counts = Counter()
    for op, n in mode.get_comm_counts().items():
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            if kind in str(op):
                counts[f"{phase} {kind}"] += n
    return counts
