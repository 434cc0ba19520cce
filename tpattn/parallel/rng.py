"""The ranks' random streams for dropout, as Megatron's model-parallel RNG tracker keeps them.

Every rank has a default stream seeded with ``seed`` (the same on every TP rank: the residual
dropout, outside the sharded region) and a model-parallel stream ``seed + 2718 + tp_rank``
(its own heads' attention dropout), as ``model_parallel_cuda_manual_seed`` in Megatron-LM's
``tensor_parallel/random.py``. ``RankStreams`` holds both for the ranks one process holds;
``replica_masks`` / ``tile_masks`` draw the correct program's masks for the dense side.
``Injection.rng = "rank0_drift"``: tp_rank 0's default stream is consumed once more before the
step, as a DataLoader built on tp_rank 0 only (Megatron-DeepSpeed PR 276) does.
"""
from __future__ import annotations

import torch

from tpattn.config import Config

__all__ = ["RankStreams", "MODEL_PARALLEL_SEED_OFFSET", "keep_mask", "simulated_streams",
           "process_streams",
           "replica_masks", "tile_masks", "drift_by_loader", "state_checksum"]

#: Megatron's offset of the model-parallel seed: ``seed + 2718 + tp_rank``.
MODEL_PARALLEL_SEED_OFFSET = 2718


def keep_mask(shape, p: float, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """A dropout mask ``shape``: each element ``1/(1-p)`` with probability ``1 - p``, else 0,
    drawn as ``bernoulli(1 - p)`` in float32 from ``generator``, then cast to ``dtype``."""
    keep = torch.empty(shape, dtype=torch.float32).bernoulli_(1.0 - p, generator=generator)
    return keep.div_(1.0 - p).to(dtype)


def drift_by_loader(generator: torch.Generator | None = None) -> None:
    """Consume one draw of ``generator`` (``None``: torch's global default generator) the way
    the data loader does: create an iterator of a ``DataLoader`` over a small dataset
    (``num_workers=0``; the iterator draws the workers' base seed all the same)."""
    from torch.utils.data import DataLoader  # imported when a run drifts

    iter(DataLoader(list(range(4)), batch_size=2, generator=generator))


def state_checksum(generator: torch.Generator) -> float:
    """A checksum of a generator's state: ``sum_i (i + 1) * byte_i`` over its state bytes
    (equal states give equal checksums; float64, exact below 2**53)."""
    state = generator.get_state().double()
    return float((state * torch.arange(1, state.numel() + 1, dtype=torch.float64)).sum())


class RankStreams:
    """The two random streams of each rank one process holds, in ``comm.ranks`` order.

    ``defaults``: each rank's default generator (same seed on every TP rank);
    ``model_parallel``: each rank's ``seed + 2718 + tp_rank`` generator. ``attention_masks``
    and ``residual_masks`` draw the next masks of every rank (each call advances the streams:
    a new step, new masks).
    """

    def __init__(self, defaults: list[torch.Generator], model_parallel: list[torch.Generator]):
        if len(defaults) != len(model_parallel):
            raise ValueError("defaults and model_parallel must hold one generator per rank "
                             f"(got {len(defaults)} and {len(model_parallel)})")
        self.defaults, self.model_parallel = list(defaults), list(model_parallel)

    def attention_masks(self, cfg: Config) -> torch.Tensor:
        """Every rank's attention-dropout mask from its model-parallel stream, heads
        rank-major: ``[B, R * Hq/W, S, S]``."""
        shape = (cfg.batch, cfg.local_query_heads, cfg.seq, cfg.seq)
        return torch.cat([keep_mask(shape, cfg.dropout, g, cfg.torch_dtype)
                          for g in self.model_parallel], dim=1)

    def residual_masks(self, cfg: Config) -> torch.Tensor:
        """Every rank's residual-dropout mask from its default stream: ``[R, S, B, hidden]``."""
        shape = (cfg.seq, cfg.batch, cfg.hidden)
        return torch.stack([keep_mask(shape, cfg.dropout, g, cfg.torch_dtype)
                            for g in self.defaults])

    def default_checksums(self) -> list[float]:
        """``state_checksum`` of every rank's default generator (what the report compared:
        ``torch_rng_state`` across TP ranks)."""
        return [state_checksum(g) for g in self.defaults]


def simulated_streams(cfg: Config, seed: int, inj=None, tp_ranks=None) -> RankStreams:
    """Every simulated rank's streams (``tp_ranks``: the TP rank of each, default every rank
    of the job in mesh order, ``r % world_size``): default generators seeded with ``seed``, model-parallel ones with
    ``seed + 2718 + tp_rank``; under ``inj.rng == "rank0_drift"`` tp_rank 0's default
    generator is then consumed by a ``DataLoader`` iterator (``drift_by_loader``)."""
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
    """The streams of one real rank (this process, TP rank ``tp_rank``): torch's global RNG
    seeded with ``seed`` (``torch.manual_seed``, as every rank does) is the default stream,
    the one ``nn.Dropout`` reads, and a ``seed + 2718 + tp_rank`` generator the
    model-parallel one. Under ``inj.rng == "rank0_drift"`` tp_rank 0 alone then creates a
    ``DataLoader`` iterator with the default generator (``drift_by_loader(None)``)."""
    torch.manual_seed(seed)
    parallel = torch.Generator().manual_seed(seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    if inj is not None and inj.rng == "rank0_drift" and tp_rank == 0:
        drift_by_loader(None)
    return RankStreams([torch.default_generator], [parallel])


def replica_masks(cfg: Config, seed: int) -> dict[str, torch.Tensor]:
    """The masks the correct program draws in one step of one DP replica, assembled over the
    TP ranks: ``attention`` ``[B, Hq, S, S]`` (rank r's heads from rank r's model-parallel
    stream) and ``residual`` ``[S, B, hidden]`` (the default stream, the same on every rank)."""
    streams = simulated_streams(cfg, seed, tp_ranks=range(cfg.world_size))
    return {"attention": streams.attention_masks(cfg),
            "residual": streams.residual_masks(cfg)[0]}


def tile_masks(masks: dict[str, torch.Tensor], data_parallel: int) -> dict[str, torch.Tensor]:
    """``replica_masks`` of one replica for a global batch of ``data_parallel`` replicas
    (every replica draws the same masks): tiled along the batch, ``attention``
    ``[dp*B, Hq, S, S]`` and ``residual`` ``[S, dp*B, hidden]``."""
    return {"attention": masks["attention"].repeat(data_parallel, 1, 1, 1),
            "residual": masks["residual"].repeat(1, data_parallel, 1)}
