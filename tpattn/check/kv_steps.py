"""Several SGD steps with fewer KV heads than ranks: how far replicated KV copies drift apart."""
from __future__ import annotations

from tpattn.block.kv_layout import replica_groups
from tpattn.block.params import init_params, shard_params
from tpattn.config import Config
from tpattn.parallel.engine import stack_ranks
from tpattn.parallel.simulated import rank0_view, simulated_step

from .core import (LR, PARAM_SEED_OFFSET, check_count, dense_reference, five_measures,
                   make_inputs, max_abs_diff)

__all__ = ["train_steps"]


def train_steps(cfg: Config, seed: int, program, steps: int = 2) -> list[dict]:
    """``steps`` SGD steps of the dense block and of the simulated ranks running
    ``program.injection``, each from its own weights, from ``tpattn.run``'s start. One dict per
    step: the five measures (rank 0's view), ``kv_replica_max_diff`` (the wk/wv copies of a
    replica group after the step), ``dense_loss`` and ``tp_loss``."""
    check_count("steps", steps)
    x0, target = make_inputs(cfg, seed)
    dense_weights = init_params(cfg, seed + PARAM_SEED_OFFSET)
    state = stack_ranks(shard_params(dense_weights, cfg))
    out = []
    for _ in range(steps):
        dense = dense_reference(x0, target, dense_weights, cfg)
        step = simulated_step(state, [(x0, target)] * cfg.world_size, cfg,
                              program.injection, LR)
        row = five_measures(seed, program.name, dense, rank0_view(step, cfg))
        row["kv_replica_max_diff"] = max(
            max_abs_diff(step["weights"][w][r], step["weights"][w][group[0]])
            for group in replica_groups(cfg) for r in group for w in ("wk", "wv"))
        row["dense_loss"], row["tp_loss"] = dense["loss"].item(), step["losses"][0].item()
        out.append(row)
        dense_weights = dense["weights"]
        state = step["weights"]
    return out
