"""A stack of attention blocks: what one block's check does not show.

A model is ``L`` blocks in a row; block ``l``'s input gradient is block ``l-1``'s output
gradient, so a bug that only corrupts ``dX`` in one block (a missing f) makes every block
below it learn wrong. ``run_stack`` measures that block by block, with one of the original
fixture's check's modes in every block (``tpattn.bugs.modes.resolve``): ``simulate=
"fixture"`` runs ``tp_forward`` and ``check.one_step``, ``"ranks"`` the engine's block and
``check.ranks_step``. Parameters live in one flat dict, ``"<block>.<name>"``.
"""
from __future__ import annotations

import torch

import torch.nn.functional as F

from .core import (ALL_MODES, LR, PARAM_SEED_OFFSET, check_seed, check_simulate, make_inputs,
                   max_abs_diff, one_step, ranks_step)
from tpattn.config import Config
from tpattn.block.dense import dense_forward
from tpattn.block.params import PARAM_NAMES, clone_trainable, init_params, shard_params, unshard_params
from tpattn.parallel.injection import Injection
from tpattn.parallel.simulated import forward_rank_list
from tpattn.parallel.tp import tp_forward

__all__ = ["init_stack", "blocks_of", "dense_stack_forward", "tp_stack_forward",
           "tp_stack_forward_ranks", "run_stack", "train_stack", "BLOCK_SEED_STRIDE"]

#: Block ``l``'s parameters are ``init_params(cfg, seed + PARAM_SEED_OFFSET + l * BLOCK_SEED_STRIDE)``:
#: block 0 is the fixture's block, the others have their own weights.
BLOCK_SEED_STRIDE = 1000


def check_layers(layers: int) -> int:
    """Return ``layers`` if it is an integer >= 1, else raise ``ValueError``."""
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be an integer >= 1 (got {layers!r})")
    return layers


def init_stack(cfg: Config, layers: int, seed: int) -> dict[str, torch.Tensor]:
    """Parameters of ``layers`` blocks in one flat dict, ``"<block>.<name>"`` → tensor.

    Block ``l`` is ``init_params(cfg, seed + l * BLOCK_SEED_STRIDE)``; shapes as in
    ``tpattn.block.params`` (``norm [hidden]``, ``wq [Hq*D, hidden]``, …).
    """
    check_layers(layers)
    flat = {}
    for layer in range(layers):
        for name, tensor in init_params(cfg, seed + layer * BLOCK_SEED_STRIDE).items():
            flat[f"{layer}.{name}"] = tensor
    return flat


def blocks_of(flat: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The flat dict split back into one parameter dict per block, in block order (the same
    tensors, not copies, so gradients land in ``flat``)."""
    layers = 1 + max(int(key.split(".", 1)[0]) for key in flat)
    return [{name: flat[f"{layer}.{name}"] for name in PARAM_NAMES} for layer in range(layers)]


def dense_stack_forward(x: torch.Tensor, flat: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    """``dense_forward`` of every block in turn. x: ``[S, B, hidden]``; returns ``[S, B, hidden]``."""
    for block in blocks_of(flat):
        x = dense_forward(x, block, cfg)
    return x


def tp_stack_forward(x: torch.Tensor, flat: dict[str, torch.Tensor], cfg: Config,
                     inj: Injection = Injection()) -> torch.Tensor:
    """``tp_forward`` of every block in turn, each wired as ``inj`` (g kept or dropped, f
    kept or dropped: a bug in the code is in every block). x: ``[S, B, hidden]``; returns
    ``[S, B, hidden]``."""
    for block in blocks_of(flat):
        x = tp_forward(x, block, cfg, reduce_output=inj.g == 1,
                       reduce_input_grad=inj.f == "sum")
    return x


def tp_stack_forward_ranks(xs: list[torch.Tensor], rank_flats: list[dict[str, torch.Tensor]],
                           cfg: Config, inj: Injection = Injection()) -> list[torch.Tensor]:
    """The engine's block (``forward_rank_list``) of every block in turn: every simulated rank's own stack.

    xs: one ``[S, B, hidden]`` per rank; ``rank_flats``: each rank's own flat dict of its
    shards of every block (``"<block>.<name>"``). Returns one ``[S, B, hidden]`` per rank.
    """
    per_rank = [blocks_of(flat) for flat in rank_flats]
    for layer in range(len(per_rank[0])):
        xs = forward_rank_list(xs, [blocks[layer] for blocks in per_rank], cfg, inj)
    return xs


def _shard_stack(flat: dict[str, torch.Tensor], cfg: Config) -> list[dict[str, torch.Tensor]]:
    """Each rank's flat dict of its shards of every block."""
    rank_flats = [{} for _ in range(cfg.world_size)]
    for layer, block in enumerate(blocks_of(flat)):
        for rank, shard in enumerate(shard_params(block, cfg)):
            rank_flats[rank].update({f"{layer}.{name}": t for name, t in shard.items()})
    return rank_flats


def _unshard_stack(rank_flats: list[dict[str, torch.Tensor]], cfg: Config) -> dict[str, torch.Tensor]:
    """Full-size tensors of every block from every rank's shards (rank 0's ``norm``)."""
    per_rank = [blocks_of(flat) for flat in rank_flats]
    flat = {}
    for layer in range(len(per_rank[0])):
        full = unshard_params([blocks[layer] for blocks in per_rank], cfg)
        flat.update({f"{layer}.{name}": t for name, t in full.items()})
    return flat


def _stack_start(seed: int, program, cfg: Config | None, layers: int, simulate: str):
    """The validated start both ``run_stack`` and ``train_stack`` take: ``(cfg, x0, target,
    base, inj)`` — the fixture's batch ``[S, B, hidden]``, the stack's parameters and the
    program of every block (``program.injection``: one of the original fixture's check's modes,
    ``ALL_MODES``)."""
    inj = getattr(program, "injection", None)
    if not isinstance(inj, Injection) or getattr(program, "name", None) not in ALL_MODES:
        raise ValueError(f"program must be a registry entry of the seed's check "
                         f"(tpattn.bugs.modes.resolve(mode)) (got {program!r})")
    check_seed(seed)
    check_layers(layers)
    check_simulate(simulate)
    cfg = Config() if cfg is None else cfg
    x0, target = make_inputs(cfg, seed)
    base = init_stack(cfg, layers, seed + PARAM_SEED_OFFSET)
    return cfg, x0, target, base, inj


def run_stack(seed: int, program, cfg: Config | None = None, layers: int = 3,
              simulate: str = "fixture") -> dict:
    """One step of a dense stack and of a TP stack (``program.injection`` in every block)
    from the same inputs and weights, compared block by block. ``program``: the mode's
    registry entry (``tpattn.bugs.modes.resolve(mode)``), one of the original fixture's check's.

    Inputs are the fixture's (``make_inputs(cfg, seed)``), block 0's weights the fixture's.
    ``simulate``: ``"fixture"`` (rank 0's view, as ``tpattn.run``'s default) or ``"ranks"``
    (every rank its own stack; the TP side reported is rank 0's output, loss and dX, and the
    gradients and weights gathered from every rank's shards, as ``tpattn.run`` does).
    Returns ``seed``, ``mode``, ``layers``, ``simulate``, the stack's
    ``forward_max_abs_diff``, ``loss_abs_diff`` and ``input_grad_max_abs_diff`` (at the
    stack's input ``x``), and ``grad_diffs`` / ``weight_diffs``: one dict per block (block 0 =
    the bottom, nearest ``x``), parameter name → ``max |dense − TP|`` of its gradient / of its
    value after the SGD step.
    """
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

    return {
        "seed": seed,
        "mode": program.name,
        "layers": layers,
        "simulate": simulate,
        "forward_max_abs_diff": max_abs_diff(dense["output"], sharded["output"]),
        "loss_abs_diff": max_abs_diff(dense["loss"], sharded["loss"]),
        "input_grad_max_abs_diff": max_abs_diff(dense["input_grad"], sharded["input_grad"]),
        "grad_diffs": per_block("grads"),
        "weight_diffs": per_block("weights"),
    }


def train_stack(seed: int, program, cfg: Config | None = None, layers: int = 1,
                steps: int = 20, simulate: str = "fixture") -> dict:
    """``steps`` SGD steps (learning rate ``LR``) of the TP stack with ``program.injection``
    in every block, on the fixture's batch, from ``run_stack``'s start.

    ``simulate="fixture"``: rank 0's view (``tp_stack_forward``); ``"ranks"``: every rank its
    own shards and ``norm`` copies, loss and update (``tp_stack_forward_ranks``). Returns
    ``losses`` (rank 0's loss before each step, ``steps`` floats) and ``norm_spread``: after
    each step, the largest ``|norm on rank r − norm on rank 0|`` over every block and rank
    (always 0 in the fixture's view, which holds one copy).
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1 (got {steps!r})")
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
