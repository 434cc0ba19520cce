"""One LM check's inputs and its two steps from a seed: parameters and tokens (``lm_inputs``),
the dense step (``dense_lm_job``) and the step on simulated ranks (``simulated_lm_job``)."""
from __future__ import annotations

import torch

from tpattn.parallel.collectives import SimulatedRanks
from tpattn.parallel.engine import stack_ranks
from .config import LMConfig
from .dense import dense_lm_step
from .params import init_lm_params
from .tp import LM_CORRECT, LMProgram, tp_lm_step

__all__ = ["TOKEN_SEED_OFFSET", "make_tokens", "lm_inputs", "dense_lm_job", "simulated_lm_job"]

#: The tokens' generator is seeded with ``seed + TOKEN_SEED_OFFSET`` (the parameters' with seed).
TOKEN_SEED_OFFSET = 1


def make_tokens(lm: LMConfig, seed: int) -> torch.Tensor:
    """Random token ids ``[S, B]`` (own generator), flat position j in rank ``j % W``'s
    vocabulary slice, so inputs and next-token targets fall in every rank's slice."""
    g = torch.Generator().manual_seed(seed)
    n, w = lm.block.seq * lm.block.batch, lm.block.world_size
    per_rank = lm.vocab // w
    tokens = torch.arange(n) % w * per_rank + torch.randint(per_rank, (n,), generator=g)
    return tokens.view(lm.block.seq, lm.block.batch)


def lm_inputs(lm: LMConfig, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(params, tokens [S, B])`` of the check with ``seed``."""
    return init_lm_params(lm, seed), make_tokens(lm, seed + TOKEN_SEED_OFFSET)


def dense_lm_job(lm: LMConfig, seed: int, lr: float, clip: bool = False) -> dict:
    """``dense_lm_step`` on ``lm_inputs(lm, seed)``."""
    p, tokens = lm_inputs(lm, seed)
    return dense_lm_step(tokens, p, lm, lr, clip)


def simulated_lm_job(lm: LMConfig, seed: int, lr: float, prog: LMProgram = LM_CORRECT) -> dict:
    """``tp_lm_step`` of ``prog`` on ``SimulatedRanks`` (with a ledger) from ``lm_inputs``
    cut by ``prog.shard``: every rank's tensors ``[W, ...]``."""
    p, tokens = lm_inputs(lm, seed)
    w = lm.block.world_size
    return tp_lm_step(stack_ranks(prog.shard(p, lm)), tokens.expand(w, -1, -1), lm,
                      SimulatedRanks(lm.block, []), lr, prog)
