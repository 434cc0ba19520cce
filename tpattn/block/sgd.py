"""The package's one SGD update, with float32 master weights for bfloat16 parameters (as
Megatron-LM's and FSDP's mixed precision keep them)."""
from __future__ import annotations

import torch

#: The dtype the update runs in and the weights after it are kept in, by parameter dtype.
MASTER_DTYPE = {torch.float64: torch.float64, torch.float32: torch.float32,
                torch.bfloat16: torch.float32}


def sgd_step(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], lr: float,
             scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A new dict ``w - (lr * scale) * g`` per name, no graph, in ``MASTER_DTYPE``."""
    step = lr * scale
    with torch.no_grad():
        out = {}
        for k, p in params.items():
            master, g = _master_dtype(k, p), grads[k]
            out[k] = (p - step * g if master == p.dtype
                      else p.to(master) - step * g.to(master))
    return out


def master_weights(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter detached in ``MASTER_DTYPE`` (float32/float64: its own storage)."""
    return {k: p.detach().to(_master_dtype(k, p)) for k, p in params.items()}


def sgd_step_in_place(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                      lr: float) -> dict[str, torch.Tensor]:
    """``m -= lr * g`` on ``master_weights(params)``, returned (DTensors keep placements)."""
    masters = master_weights(params)
    with torch.no_grad():
        for k, m in masters.items():
            m -= lr * grads[k].to(m.dtype)
    return masters


def _master_dtype(name: str, p: torch.Tensor) -> torch.dtype:
    master = MASTER_DTYPE.get(p.dtype)
    if master is None:
        raise ValueError(f"params[{name!r}].dtype must be one of float64, float32, "
                         f"bfloat16 (got {p.dtype})")
    return master
