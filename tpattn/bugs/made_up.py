"""Made-up bugs of the held-out evaluation (``tpattn.diagnosis.evaluate``), no registry entry:
the stages ``Injection.partial_scale`` and ``rank_lr_scale`` name (``wrong.MADE_UP_STAGES``)."""
from __future__ import annotations

import torch

from tpattn.parallel.program import sgd_ranks
from tpattn.parallel.wrong import MADE_UP_STAGES

__all__ = ["scaled_partials", "lr_scaled"]


def scaled_partials(scale):
    """``before_g``: the partials ``[R, S, B, hidden]`` times ``scale`` (or ``scale[r]``)."""
    def before_g(partial: torch.Tensor, p: dict, comm) -> torch.Tensor:
        if isinstance(scale, tuple):
            return partial * partial.new_tensor([scale[r] for r in comm.ranks]).view(-1, 1, 1, 1)
        return partial * scale
    return before_g


def lr_scaled(scales: tuple):
    """An ``update`` stage: TP rank r's SGD step with its learning rate times ``scales[r]``."""
    def update(ps: dict, grads: dict, lr: float, coefs: list[float], comm) -> dict:
        return sgd_ranks(ps, grads, lr, [scales[r] * c for r, c in zip(comm.ranks, coefs)], comm)
    return update


MADE_UP_STAGES.update(partial_scale=scaled_partials, rank_lr_scale=lr_scaled)
