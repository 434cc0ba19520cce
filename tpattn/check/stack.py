"""A stack of attention blocks, parameters in one flat dict ``"<block>.<name>"``: ``run_stack``
measures block by block how a bug in ``dX`` (a missing f) reaches the blocks below."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .core import (ALL_MODES, LR, PARAM_SEED_OFFSET, check_count, check_seed, check_simulate,
                   make_inputs, one_step, ranks_step)
from .measures import MEASURES, five_measures, max_abs_diff
from tpattn.config import Config
from tpattn.block.dense import dense_forward
from tpattn.block.params import PARAM_NAMES, clone_trainable, init_params, shard_params, unshard_params
from tpattn.parallel.injection import Injection
from tpattn.parallel.simulated import forward_rank_list
from tpattn.parallel.tp import tp_forward

__all__ = ["init_stack", "blocks_of", "dense_stack_forward", "tp_stack_forward",
           "tp_stack_forward_ranks", "run_stack", "train_stack", "BLOCK_SEED_STRIDE"]

#: Block ``l`` draws its parameters from ``seed + l * BLOCK_SEED_STRIDE`` (block 0: the fixture's).
BLOCK_SEED_STRIDE = 1000


def init_stack(cfg: Config, layers: int, seed: int) -> dict[str, torch.Tensor]:
    """``layers`` blocks' parameters, flat; block ``l``: ``init_params(cfg, seed + l *
    BLOCK_SEED_STRIDE)``."""
    check_count("layers", layers)
    return _flat([init_params(cfg, seed + layer * BLOCK_SEED_STRIDE) for layer in range(layers)])


def _flat(blocks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One parameter dict per block as one flat dict ``"<block>.<name>"`` (the same tensors)."""
    return {f"{layer}.{name}": t for layer, block in enumerate(blocks) for name, t in block.items()}


def blocks_of(flat: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The flat dict as one parameter dict per block, in order (the same tensors)."""
    layers = 1 + max(int(key.split(".", 1)[0]) for key in flat)
    return [{name: flat[f"{layer}.{name}"] for name in PARAM_NAMES} for layer in range(layers)]


def dense_stack_forward(x: torch.Tensor, flat: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    """``dense_forward`` of every block in turn. x: ``[S, B, hidden]``; returns ``[S, B, hidden]``."""
    for block in blocks_of(flat):
        x = dense_forward(x, block, cfg)
    return x


def tp_stack_forward(x: torch.Tensor, flat: dict[str, torch.Tensor], cfg: Config,
                     inj: Injection = Injection()) -> torch.Tensor:
    """``tp_forward`` of every block in turn, each with ``inj``'s f and g. x: ``[S, B, hidden]``;
    returns ``[S, B, hidden]``."""
    for block in blocks_of(flat):
        x = tp_forward(x, block, cfg, reduce_output=inj.g == 1,
                       reduce_input_grad=inj.f == "sum")
    return x


def tp_stack_forward_ranks(xs: list[torch.Tensor], rank_flats: list[dict[str, torch.Tensor]],
                           cfg: Config, inj: Injection = Injection()) -> list[torch.Tensor]:
    """``forward_rank_list`` of every block in turn, each rank its own flat shards: one ``[S, B,
    hidden]`` per rank in and out."""
    for blocks in zip(*map(blocks_of, rank_flats)):
        xs = forward_rank_list(xs, list(blocks), cfg, inj)
    return xs


def _shard_stack(flat: dict[str, torch.Tensor], cfg: Config) -> list[dict[str, torch.Tensor]]:
    """Each rank's flat dict of its shards of every block."""
    return [_flat(blocks) for blocks in zip(*(shard_params(b, cfg) for b in blocks_of(flat)))]


def _unshard_stack(rank_flats: list[dict[str, torch.Tensor]], cfg: Config) -> dict[str, torch.Tensor]:
    """Full-size tensors of every block from every rank's shards (rank 0's ``norm``)."""
    return _flat([unshard_params(list(blocks), cfg) for blocks in zip(*map(blocks_of, rank_flats))])


def _stack_start(seed: int, program, cfg: Config | None, layers: int, simulate: str):
    """``(cfg, x0, target, base, inj)``, validated: the fixture's batch, the stack's parameters,
    ``program.injection`` (a mode of ``ALL_MODES``)."""
    inj = getattr(program, "injection", None)
    if not isinstance(inj, Injection) or getattr(program, "name", None) not in ALL_MODES:
        raise ValueError(f"program must be a registry entry of the original fixture's check "
                         f"(tpattn.bugs.modes.resolve(mode)) (got {program!r})")
    check_seed(seed)
    check_count("layers", layers)
    check_simulate(simulate)
    cfg = Config() if cfg is None else cfg
    x0, target = make_inputs(cfg, seed)
    base = init_stack(cfg, layers, seed + PARAM_SEED_OFFSET)
    return cfg, x0, target, base, inj


def run_stack(seed: int, program, cfg: Config | None = None, layers: int = 3,
              simulate: str = "fixture") -> dict:
    """One step of a dense and a TP stack (``program.injection`` in every block) from the
    fixture's start. Returns ``seed``, ``mode``, ``layers``, ``simulate``, the forward, loss and
    input gradient measures, and ``grad_diffs`` / ``weight_diffs``: per block (0 nearest ``x``)
    name → ``max |dense − TP|`` of its gradient / its value after the step."""
    cfg, x0, target, base, inj = _stack_start(seed, program, cfg, layers, simulate)

    dense = one_step(lambda x, p: dense_stack_forward(x, p, cfg), x0, target, base)
    if simulate == "ranks":
        steps = ranks_step(lambda xs, ps: tp_stack_forward_ranks(xs, ps, cfg, inj),
                           x0, target, _shard_stack(base, cfg))
        sharded = {**steps[0], "grads": _unshard_stack([s["grads"] for s in steps], cfg),
                   "weights": _unshard_stack([s["weights"] for s in steps], cfg)}
    else:
        sharded = one_step(lambda x, p: tp_stack_forward(x, p, cfg, inj), x0, target, base)

    def per_block(key):
        return [{name: max_abs_diff(dense[key][f"{layer}.{name}"], sharded[key][f"{layer}.{name}"])
                 for name in PARAM_NAMES} for layer in range(layers)]

    measures = five_measures(seed, program.name, dense, sharded)
    return {"seed": seed, "mode": program.name, "layers": layers, "simulate": simulate,
            **{m: measures[m] for m in MEASURES[:3]},
            "grad_diffs": per_block("grads"), "weight_diffs": per_block("weights")}


def train_stack(seed: int, program, cfg: Config | None = None, layers: int = 1,
                steps: int = 20, simulate: str = "fixture") -> dict:
    """``steps`` SGD steps of the TP stack from ``run_stack``'s start (``"ranks"``: every rank
    its own shards and update). Returns ``losses`` (rank 0's, before each step) and
    ``norm_spread`` (after each step the largest ``|norm_r − norm_0|``)."""
    check_count("steps", steps)
    cfg, x0, target, base, inj = _stack_start(seed, program, cfg, layers, simulate)
    ranks = simulate == "ranks"
    per_rank = [clone_trainable(flat) for flat in _shard_stack(base, cfg)] if ranks \
        else [clone_trainable(base)]
    losses, spread = [], []
    for _ in range(steps):
        if ranks:
            ys = tp_stack_forward_ranks([x0.clone() for _ in per_rank], per_rank, cfg, inj)
        else:
            ys = [tp_stack_forward(x0, per_rank[0], cfg, inj)]
        rank_losses = [F.mse_loss(y, target) for y in ys]
        leaves = [t for flat in per_rank for t in flat.values()]
        grads = torch.autograd.grad(sum(rank_losses), leaves)
        with torch.no_grad():
            for t, g in zip(leaves, grads):
                t -= LR * g
        losses.append(rank_losses[0].item())
        spread.append(max((flat[f"{layer}.norm"] - per_rank[0][f"{layer}.norm"]).abs().max().item()
                          for flat in per_rank for layer in range(layers)))
    return {"seed": seed, "mode": program.name, "layers": layers, "steps": steps, "simulate": simulate,
            "losses": losses, "norm_spread": spread}
