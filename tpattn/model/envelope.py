"""Rounding or a bug, at step N: a run's divergence from its dense twin over N SGD steps, judged
against the divergence of dense runs started one rounding away (a rounding envelope)."""
from __future__ import annotations

from typing import Callable

import torch

from tpattn.block.sgd import master_weights, sgd_step
from tpattn.parallel.collectives import SimulatedRanks
from tpattn.parallel.engine import stack_ranks
from .config import LMConfig
from .dense import dense_lm_step
from .params import shard_lm_params
from .tp import LM_CORRECT, LMProgram, gather_lm_step, tp_lm_step

__all__ = ["METRICS", "dense_step_fn", "tp_step_fn", "train_curve", "divergence",
           "perturb_ulp", "perturbed_step_fn", "rounding_envelope", "drift",
           "verdict"]

#: The divergences ``divergence`` measures per step.
METRICS = ("weights", "loss")
#: Integer views of a float's bits, so +-1 moves it by one unit in the last place.
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}

StepFn = Callable[[dict, torch.Tensor], tuple]


def dense_step_fn(lm: LMConfig) -> StepFn:
    """``(params, tokens [S, B]) -> (loss, grads)`` of the dense LM in ``lm``'s dtype."""
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
        out = tp_lm_step(stack_ranks(shard_lm_params(p, lm)), tokens.expand(w, -1, -1), lm,
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


def perturb_ulp(params: dict, dtype: torch.dtype, fraction: float, seed: int) -> dict:
    """A copy of ``params`` in ``dtype``, each entry moved by +-1 ulp of ``dtype`` with
    probability ``fraction`` (own generator from ``seed``); zeros stay zero."""
    if dtype not in _BITS:
        raise ValueError(f"perturb_ulp: dtype must be one of {sorted(map(str, _BITS))} "
                         f"(got {dtype})")
    if not 0 < fraction <= 1:
        raise ValueError(f"perturb_ulp: fraction must be in (0, 1] (got {fraction!r})")
    g, out = torch.Generator().manual_seed(seed), {}
    for k, t in params.items():
        hit = torch.rand(t.shape, generator=g) < fraction
        sign = torch.randint(2, t.shape, generator=g) * 2 - 1
        x = t.detach().to(dtype).clone()
        bits = x.view(_BITS[dtype])
        bits += torch.where(hit & (x != 0), sign, 0).to(bits.dtype)
        out[k] = x
    return out


def perturbed_step_fn(step_fn: StepFn, fraction: float, seed: int) -> StepFn:
    """``step_fn`` with every step's gradients one rounding away: ``perturb_ulp`` in their own
    dtype (seed ``seed`` then the step's index)."""
    calls = [0]

    def step(params: dict, tokens: torch.Tensor) -> tuple:
        loss, grads = step_fn(params, tokens)
        dtype = next(iter(grads.values())).dtype
        calls[0] += 1
        return loss, perturb_ulp(grads, dtype, fraction, seed * 1_000_003 + calls[0])
    return step


def rounding_envelope(step_fn: StepFn, params: dict, batches: list, lr: float, dense: dict,
                      k: int = 3, fraction: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Per step ``[N]``: the largest ``weights`` divergence from ``dense`` (``step_fn``'s own
    curve) of ``k`` runs of ``step_fn`` whose gradients are one rounding away each step."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"rounding_envelope: k must be an integer >= 1 (got {k!r})")
    runs = [train_curve(perturbed_step_fn(step_fn, fraction, seed + i), params, batches, lr)
            for i in range(k)]
    return torch.stack([divergence(run, dense)["weights"] for run in runs]).amax(0)


def drift(curve: dict) -> torch.Tensor:
    """Per step ``[N]``: how far training has moved the weights, ``|W_n - W_start| / |W_start|``."""
    return (curve["weights"] - curve["start"]).norm(dim=1) / curve["start"].norm()


def verdict(dense: dict, run: dict, envelope: torch.Tensor, margin: float) -> str:
    """``"rounding"``, ``"bug from step n"`` (n counts updates from 1: the first step whose
    ``weights`` divergence exceeds ``margin`` x ``envelope`` ``[N]``) or ``"inconclusive
    (reason)"`` when ``margin`` x the envelope reaches the dense run's own ``drift``."""
    if not margin >= 1:
        raise ValueError(f"verdict: margin must be >= 1 (got {margin!r})")
    if envelope.shape != dense["losses"].shape:
        raise ValueError(f"verdict: envelope must have one value per step, shape "
                         f"{tuple(dense['losses'].shape)} (got {tuple(envelope.shape)})")
    if not bool((envelope > 0).all()):
        return "inconclusive (the envelope is zero at some step: the perturbation had no effect)"
    outside = (divergence(run, dense)["weights"] > margin * envelope).nonzero()
    saturated = (margin * envelope >= drift(dense)).nonzero()
    first_out = int(outside[0]) if len(outside) else None
    first_sat = int(saturated[0]) if len(saturated) else None
    if first_out is not None and (first_sat is None or first_out < first_sat):
        return f"bug from step {first_out + 1}"
    if first_sat is not None:
        return (f"inconclusive (from step {first_sat + 1} the envelope times the margin "
                f"reaches the training's own drift: rounding and a bug look alike)")
    return "rounding"
