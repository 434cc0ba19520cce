"""One SGD update, used by every training step of the package.

(Minimal float version; the tolerance work adds fp32 master weights for bfloat16.)
"""
from __future__ import annotations

import torch

__all__ = ["sgd_step"]


def sgd_step(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], lr: float,
             scale: float = 1.0) -> dict[str, torch.Tensor]:
    """``{name: p - lr * scale * g}`` for every parameter (new tensors, no autograd).

    params, grads: tensors of one shape per name (any shape). ``scale``: a factor on the
    step, e.g. a clipping coefficient (a float, or a tensor that broadcasts, such as one
    factor per simulated rank ``[R, 1, ...]``)."""
    with torch.no_grad():
        return {k: p - lr * scale * grads[k] for k, p in params.items()}
