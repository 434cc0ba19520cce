"""The ranks' random streams for dropout, as Megatron's model-parallel RNG tracker keeps them:
a default stream seeded with ``seed`` on every TP rank (residual dropout) and a model-parallel
one seeded with ``seed + 2718 + tp_rank`` (attention dropout on the rank's own heads)."""
from __future__ import annotations

import torch

from tpattn.config import Config

__all__ = ["RankStreams", "MODEL_PARALLEL_SEED_OFFSET", "keep_mask", "simulated_streams",
           "process_streams", "replica_masks", "tile_masks", "drift_by_loader", "state_checksum"]

#: Megatron's offset of the model-parallel seed: ``seed + 2718 + tp_rank``.
MODEL_PARALLEL_SEED_OFFSET = 2718


def keep_mask(shape, p: float, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """A dropout mask ``shape``: ``1/(1-p)`` with probability ``1 - p``, else 0 (drawn in
    float32 from ``generator``, cast to ``dtype``)."""
    keep = torch.empty(shape, dtype=torch.float32).bernoulli_(1.0 - p, generator=generator)
    return keep.div_(1.0 - p).to(dtype)


def drift_by_loader(generator: torch.Generator | None = None) -> None:
    """Consume one draw of ``generator`` (``None``: torch's global one) as a ``DataLoader``
    iterator does (it draws its workers' base seed, even with ``num_workers=0``)."""
    from torch.utils.data import DataLoader  # imported when a run drifts

    iter(DataLoader(list(range(4)), batch_size=2, generator=generator))


def state_checksum(generator: torch.Generator) -> float:
    """``sum_i (i + 1) * byte_i`` over a generator's state bytes (float64, exact)."""
    state = generator.get_state().double()
    return float((state * torch.arange(1, state.numel() + 1, dtype=torch.float64)).sum())


class RankStreams:
    """Each rank's ``defaults`` and ``model_parallel`` generators (``comm.ranks`` order)."""

    def __init__(self, defaults: list[torch.Generator], model_parallel: list[torch.Generator]):
        self.defaults, self.model_parallel = list(defaults), list(model_parallel)

    def attention_masks(self, cfg: Config) -> torch.Tensor:
        """Every rank's attention mask (model-parallel stream): ``[B, R * Hq/W, S, S]``."""
        shape = (cfg.batch, cfg.local_query_heads, cfg.seq, cfg.seq)
        return torch.cat([keep_mask(shape, cfg.dropout, g, cfg.torch_dtype)
                          for g in self.model_parallel], dim=1)

    def residual_masks(self, cfg: Config) -> torch.Tensor:
        """Every rank's residual mask (default stream): ``[R, S, B, hidden]``."""
        shape = (cfg.seq, cfg.batch, cfg.hidden)
        return torch.stack([keep_mask(shape, cfg.dropout, g, cfg.torch_dtype)
                            for g in self.defaults])

    def default_checksums(self) -> list[float]:
        """``state_checksum`` of every rank's default generator."""
        return [state_checksum(g) for g in self.defaults]


def simulated_streams(cfg: Config, seed: int, inj=None, tp_ranks=None) -> RankStreams:
    """Every simulated rank's streams (``tp_ranks``: each one's TP rank, default ``r %
    world_size`` over ``cfg.ranks``); ``inj.rng == "rank0_drift"``: tp_rank 0's default
    generator then drifts (``drift_by_loader``)."""
    tp_ranks = [r % cfg.world_size for r in range(cfg.ranks)] if tp_ranks is None \
        else list(tp_ranks)
    defaults = [torch.Generator().manual_seed(seed) for _ in tp_ranks]
    parallel = [torch.Generator().manual_seed(seed + MODEL_PARALLEL_SEED_OFFSET + r)
                for r in tp_ranks]
    if inj is not None and inj.rng == "rank0_drift":
        for g, r in zip(defaults, tp_ranks):
            if r == 0:
                drift_by_loader(g)
    return RankStreams(defaults, parallel)


def process_streams(cfg: Config, seed: int, tp_rank: int, inj=None) -> RankStreams:
    """This process's streams: torch's global generator (``nn.Dropout``'s) and its own."""
    torch.manual_seed(seed)
    parallel = torch.Generator().manual_seed(seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    if inj is not None and inj.rng == "rank0_drift" and tp_rank == 0:
        drift_by_loader(None)
    return RankStreams([torch.default_generator], [parallel])


def replica_masks(cfg: Config, seed: int) -> dict[str, torch.Tensor]:
    """A replica's step masks: ``attention`` ``[B, Hq, S, S]``, ``residual`` ``[S, B, hidden]``."""
    streams = simulated_streams(cfg, seed, tp_ranks=range(cfg.world_size))
    return {"attention": streams.attention_masks(cfg),
            "residual": streams.residual_masks(cfg)[0]}


def tile_masks(masks: dict[str, torch.Tensor], data_parallel: int) -> dict[str, torch.Tensor]:
    """``replica_masks`` tiled along the batch: ``[dp*B, Hq, S, S]``, ``[S, dp*B, hidden]``."""
    return {"attention": masks["attention"].repeat(data_parallel, 1, 1, 1),
            "residual": masks["residual"].repeat(1, data_parallel, 1)}
