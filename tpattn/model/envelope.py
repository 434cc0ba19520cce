"""Rounding or a bug, at step N: a run's divergence from its dense twin over N SGD steps (relative
weight distance per step), judged against the largest divergence of K dense twins one rounding
away (each step's gradient rounding error sign-flipped at random): the rounding envelope."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from tpattn.block.sgd import master_weights, sgd_step
from tpattn.parallel.collectives import SimulatedRanks
from tpattn.parallel.engine import stack_ranks
from .config import LMConfig
from .dense import dense_lm_step
from .tp import LM_CORRECT, LMProgram, gather_lm_step, tp_lm_step

__all__ = ["METRICS", "dense_step_fn", "tp_step_fn", "train_curve", "divergence",
           "flipped_rounding_fn", "rounding_envelope", "drift", "verdict"]

#: The divergences ``divergence`` measures per step; ``verdict`` judges ``weights`` (smooth, and
#: a gradient-only bug shows after the first update; the loss's is whole ulps of the loss).
METRICS = ("weights", "loss")

StepFn = Callable[[dict, torch.Tensor], tuple]


def dense_step_fn(lm: LMConfig, dtype: str | None = None) -> StepFn:
    """``(params, tokens [S, B]) -> (loss, grads)`` of the dense LM in ``dtype`` (default
    ``lm``'s; ``"float64"`` for the exact reference of ``rounding_envelope``)."""
    lm = lm if dtype is None else replace(lm, block=replace(lm.block, dtype=dtype))

    def step(params: dict, tokens: torch.Tensor) -> tuple:
        p = {k: t.to(lm.block.torch_dtype) for k, t in params.items()}
        out = dense_lm_step(tokens, p, lm, 0.0)
        return float(out["loss"]), out["grads"]
    return step


def tp_step_fn(lm: LMConfig, prog: LMProgram = LM_CORRECT) -> StepFn:
    """``(params, tokens [S, B]) -> (rank 0's loss, unsharded grads)`` of TP ``prog`` on
    simulated ranks, parameters sharded from the dense ones in ``lm``'s dtype."""
    w = lm.block.world_size

    def step(params: dict, tokens: torch.Tensor) -> tuple:
        p = {k: t.to(lm.block.torch_dtype) for k, t in params.items()}
        out = tp_lm_step(stack_ranks(prog.shard(p, lm)), tokens.expand(w, -1, -1), lm,
                         SimulatedRanks(lm.block), 0.0, prog)
        return float(out["losses"][0]), gather_lm_step(out, lm)["grads"]
    return step


def train_curve(step_fn: StepFn, params: dict, batches: list, lr: float) -> dict:
    """N SGD steps of ``step_fn`` on token batches ``[S, B]`` (master weights, ``sgd_step``):
    ``losses`` ``[N]`` (before each update), ``weights`` ``[N, P]`` (flat, after it) and
    ``start`` ``[P]`` (before the first), float64."""
    if not batches:
        raise ValueError("train_curve: batches must hold at least one token batch (got 0)")
    if not lr > 0:
        raise ValueError(f"train_curve: lr must be > 0 (got {lr!r})")
    w, losses, flat = master_weights(params), [], []
    start = torch.cat([t.detach().reshape(-1).double() for t in w.values()])
    for tokens in batches:
        loss, grads = step_fn(w, tokens)
        w = sgd_step(w, grads, lr)
        losses.append(loss)
        flat.append(torch.cat([t.detach().reshape(-1).double() for t in w.values()]))
    return {"losses": torch.tensor(losses, dtype=torch.float64), "weights": torch.stack(flat),
            "start": start}


def divergence(run: dict, dense: dict) -> dict[str, torch.Tensor]:
    """Per step ``[N]``: ``weights`` ``|W_run - W| / |W|`` (L2 over all parameters) and
    ``loss`` ``|L_run - L| / |L|``, each against the dense curve."""
    if run["losses"].shape != dense["losses"].shape:
        raise ValueError(f"divergence: run and dense must have the same number of steps "
                         f"(got {run['losses'].shape[0]} and {dense['losses'].shape[0]})")
    dw = (run["weights"] - dense["weights"]).norm(dim=1) / dense["weights"].norm(dim=1)
    dl = (run["losses"] - dense["losses"]).abs() / dense["losses"].abs()
    return {"weights": dw, "loss": dl}


def flipped_rounding_fn(step_fn: StepFn, exact_fn: StepFn, seed: int) -> StepFn:
    """A twin of ``step_fn`` one rounding away: each step's gradient is ``exact_fn``'s (float64,
    at the same weights rounded to the gradient dtype) plus ``step_fn``'s own rounding error,
    its sign flipped at random per entry (own generator from ``seed``), in the gradient dtype."""
    g = torch.Generator().manual_seed(seed)

    def step(params: dict, tokens: torch.Tensor) -> tuple:
        loss, grads = step_fn(params, tokens)
        _, exact = exact_fn({k: t.to(grads[k].dtype) for k, t in params.items()}, tokens)
        out = {}
        for k, t in grads.items():
            sign = torch.randint(2, t.shape, generator=g, dtype=torch.float64) * 2 - 1
            out[k] = (exact[k] + sign * (t.double() - exact[k])).to(t.dtype)
        return loss, out
    return step


def rounding_envelope(step_fn: StepFn, exact_fn: StepFn, params: dict, batches: list,
                      lr: float, dense: dict, k: int = 3, seed: int = 0) -> torch.Tensor:
    """Per step ``[N]``: the largest ``weights`` divergence from ``dense`` (``step_fn``'s own
    curve) of ``k`` runs of ``flipped_rounding_fn`` twins (seeds ``seed`` .. ``seed + k - 1``)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"rounding_envelope: k must be an integer >= 1 (got {k!r})")
    runs = [train_curve(flipped_rounding_fn(step_fn, exact_fn, seed + i), params, batches, lr)
            for i in range(k)]
    return torch.stack([divergence(run, dense)["weights"] for run in runs]).amax(0)


def drift(curve: dict) -> torch.Tensor:
    """Per step ``[N]``: how far training moved the weights, ``|W_n - W_start| / |W_start|``."""
    return (curve["weights"] - curve["start"]).norm(dim=1) / curve["start"].norm()


def verdict(dense: dict, run: dict, envelope: torch.Tensor, margin: float) -> str:
    """``"rounding"``, ``"bug from step n"`` (n counts updates from 1: the first step whose
    ``weights`` divergence exceeds ``margin`` x ``envelope`` ``[N]`` or is NaN) or ``"inconclusive
    (reason)"`` when ``margin`` x the envelope reaches the dense run's own ``drift``."""
    if not margin >= 1:
        raise ValueError(f"verdict: margin must be >= 1 (got {margin!r})")
    if envelope.shape != dense["losses"].shape:
        raise ValueError(f"verdict: envelope must have one value per step, shape "
                         f"{tuple(dense['losses'].shape)} (got {tuple(envelope.shape)})")
    if not bool((envelope > 0).all()):
        return ("inconclusive (the envelope is zero at some step: the twins' rounding equals "
                "the reference's, as in float64)")
    outside = (~(divergence(run, dense)["weights"] <= margin * envelope)).nonzero()  # NaN: out
    saturated = (margin * envelope >= drift(dense)).nonzero()
    first_out = int(outside[0]) if len(outside) else None
    first_sat = int(saturated[0]) if len(saturated) else None
    if first_out is not None and (first_sat is None or first_out < first_sat):
        return f"bug from step {first_out + 1}"
    if first_sat is not None:
        return (f"inconclusive (rounding through step {first_sat}; from step {first_sat + 1} "
                f"margin x envelope reaches the training's own drift, so a bug cannot leave it)")
    return "rounding"
