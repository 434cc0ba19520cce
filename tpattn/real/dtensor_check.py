"""Cross-check with PyTorch's own tensor-parallel API (DTensor).

``AttentionBlock``: the dense block as an ``nn.Module`` (``wq, wk, wv, wo`` are
``nn.Linear(bias=False)``), sharded by ``parallelize_module`` with Megatron's plan: wq, wk, wv
``ColwiseParallel`` (weight ``Shard(0)``), wo ``RowwiseParallel`` (weight ``Shard(1)``).
PyTorch places the collectives itself: Rowwise sums the partials in forward (g), each
Colwise layer's replicated input sums its gradient in backward (f). The forward reads head
counts from the (local) weights. Run on every rank of an initialized default process group;
importing this module loads ``torch.distributed.tensor`` (seconds): ``import tpattn`` does not.
"""
from __future__ import annotations

import torch
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

__all__ = ["AttentionBlock", "parallelize_block", "full_value", "dtensor_check"]


class AttentionBlock(nn.Module):
    """``dense_forward`` as an ``nn.Module``, so that ``parallelize_module`` can shard it.

    The forward is the package's layer functions in ``dense_forward``'s order; head counts are
    read from the projections' (possibly rank-local) output width, never from ``cfg``, and the
    sequence length from ``wq``'s output (``dtensor_sp.SequenceParallelBlock``, a subclass,
    gathers the tokens inside ``wq``). Subclasses change only ``make_norm``/``normalize``.
    """

    def __init__(self, params: dict[str, torch.Tensor], cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.norm = self.make_norm(params["norm"], cfg.eps)
        for name in ("wq", "wk", "wv", "wo"):
            out_features, in_features = params[name].shape
            linear = nn.Linear(in_features, out_features, bias=False,
                               device=params[name].device, dtype=params[name].dtype)
            with torch.no_grad():
                linear.weight.copy_(params[name])
            setattr(self, name, linear)

    def make_norm(self, weight: torch.Tensor, eps: float) -> nn.Module | nn.Parameter:
        """The ``norm`` weight ``[hidden]`` as a parameter (``normalize`` applies it)."""
        return nn.Parameter(weight.clone())

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``rms_norm`` of x ``[..., hidden]`` with ``norm``; returns ``[..., hidden]``."""
        return rms_norm(x, self.norm, self.cfg.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[S, B, hidden]``; returns ``[S, B, hidden]``."""
        n = self.normalize(x)
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


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (an all-gather), or a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def dtensor_check(seed: int, cfg: Config, device: torch.device | str = "cpu") -> tuple[dict, dict]:
    """The five measures of ``run(seed, "equivalence", cfg)`` with the TP side done by DTensor.

    Call on every rank. Returns ``(metrics, ledger)``: ``metrics`` has ``run()``'s keys and order
    (mode ``"equivalence"``), computed on every rank; ``ledger`` counts the all-reduces DTensor
    issued in forward and in backward (``CommDebugMode``), as
    ``{"forward": int, "backward": int}``.
    """
    device = torch.device(device)
    x0, target = (t.to(device) for t in make_inputs(cfg, seed))
    base = {k: v.to(device) for k, v in init_params(cfg, seed + PARAM_SEED_OFFSET).items()}

    block = parallelize_block(AttentionBlock(base, cfg), cfg.world_size, device.type)
    x = x0.clone().requires_grad_(True)
    with CommDebugMode() as forward_comms:
        y = block(x)
    loss = F.mse_loss(y, target)
    with CommDebugMode() as backward_comms:
        loss.backward()
    ledger = {"forward": _count_all_reduce(forward_comms),
              "backward": _count_all_reduce(backward_comms)}

    params = {"norm": block.norm, **{k: getattr(block, k).weight for k in ("wq", "wk", "wv", "wo")}}
    grads = {k: full_value(params[k].grad) for k in PARAM_NAMES}
    stepped = sgd_step_in_place(params, {k: p.grad for k, p in params.items()}, LR)
    tp = {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad, "grads": grads,
          "weights": {k: full_value(stepped[k]) for k in PARAM_NAMES}}
    return five_measures(seed, EQUIVALENCE, dense_reference(x0, target, base, cfg), tp), ledger


def _count_all_reduce(mode) -> int:
    """All-reduces (functional or c10d) a ``CommDebugMode`` recorded."""
    return sum(n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op))
