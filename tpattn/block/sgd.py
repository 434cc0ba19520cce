"""The package's one SGD update, as mixed-precision TP trains it.

Mixed-precision bfloat16 training keeps float32 *master weights* in the optimizer (Megatron-LM's
float16 optimizers with ``main_grad``; FSDP's mixed precision): the forward and backward run in
bfloat16, the update ``w - lr g`` runs in float32 on the float32 copy (a model loaded in
bfloat16 and stepped as it is updates bfloat16 weights instead). Updating in bfloat16
itself would round the step away (bfloat16's spacing near ``|w| = 0.15`` is ``2**-10``, larger
than most ``lr * g``), and a check comparing bfloat16 weights after the step would see only
that rounding.
"""
from __future__ import annotations

import torch

#: The dtype the update runs in and the weights after it are kept in, by parameter dtype.
MASTER_DTYPE = {torch.float64: torch.float64, torch.float32: torch.float32,
                torch.bfloat16: torch.float32}


def sgd_step(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], lr: float,
             scale: float = 1.0) -> dict[str, torch.Tensor]:
    """One SGD step ``w' = w - (lr * scale) * g`` for every name of ``params``; a new dict.

    params, grads: tensors by name, ``grads[k]`` of ``params[k]``'s shape (any shape, e.g.
    ``wq`` ``[Hq*D, hidden]``, ``norm`` ``[hidden]``); ``scale`` multiplies the learning rate
    (e.g. ``1 / accumulation steps``). float32/float64: ``p - lr * scale * g`` in that dtype,
    bit for bit the original fixture's update. bfloat16: the float32 master weights
    ``p.float() - lr * scale * g.float()`` (``MASTER_DTYPE``): float32 tensors of the same
    shapes. No autograd graph is recorded; ``params`` and ``grads`` are not modified.
    """
    step = lr * scale
    with torch.no_grad():
        out = {}
        for k, p in params.items():
            master, g = _master_dtype(k, p), grads[k]
            out[k] = (p - step * g if master == p.dtype
                      else p.to(master) - step * g.to(master))
    return out


def master_weights(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors an in-place SGD step updates, by name: each parameter detached, in
    ``MASTER_DTYPE`` (float32/float64: the parameter's own storage, so the step updates it;
    bfloat16: a float32 copy)."""
    return {k: p.detach().to(_master_dtype(k, p)) for k, p in params.items()}


def sgd_step_in_place(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                      lr: float) -> dict[str, torch.Tensor]:
    """``sgd_step``'s update done in place, ``m -= lr * g`` on ``master_weights(params)``, for
    tensors that must be stepped where they are (e.g. DTensors, whose placements it keeps);
    returns the stepped master weights. Float32/float64 parameters are themselves updated."""
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
