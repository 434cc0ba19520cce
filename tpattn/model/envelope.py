"""Rounding or a bug, at step N: a run's divergence from its dense twin over N SGD steps (relative
weight distance per step), judged against the largest divergence of K dense twins one rounding
away (each step's gradient rounding error sign-flipped at random): the rounding envelope."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from tpattn.block.sgd import master_weights, sgd_step
from tpattn.parallel.collectives import SimulatedRanks
from tpattn.parallel.engine import MAX_GRAD_NORM, stack_ranks, unstack_ranks
from .config import LMConfig
from .dense import dense_lm_step
from .params import unshard_lm_params
from .tp import LM_CORRECT, LMProgram, clip_coefs, lm_grad_norm, tp_lm_step

__all__ = ["METRICS", "clip_scale", "scale_grads", "dense_step_fn", "tp_step_fn", "train_curve",
           "divergence", "flipped_rounding_fn", "rounding_envelope", "drift", "assess", "verdict",
           "replayed", "make_batches", "reference_curves", "judge_curves"]

#: The divergences ``divergence`` measures per step; ``verdict`` judges ``weights`` (smooth, and
#: a gradient-only bug shows after the first update; the loss's is whole ulps of the loss).
METRICS = ("weights", "loss")

StepFn = Callable[[dict, torch.Tensor], tuple]


def clip_scale(norm: float, clip: bool) -> float:
    """The update scale of clipping by the gradient norm: ``min(1, MAX_GRAD_NORM / (norm +
    1e-6))`` if ``clip``, else 1 (as ``dense_lm_step`` and ``tp_lm_step`` scale it)."""
    return min(1.0, MAX_GRAD_NORM / (norm + 1e-6)) if clip else 1.0


def scale_grads(grads: dict, scale: float) -> dict:
    """``grads`` times ``scale`` (the same dict when ``scale`` is 1)."""
    return grads if scale == 1.0 else {k: g * scale for k, g in grads.items()}


def dense_step_fn(lm: LMConfig, dtype: str | None = None, clip: bool = False) -> StepFn:
    """``(params, tokens [S, B]) -> (loss, grads)`` of the dense LM in ``dtype`` (default
    ``lm``'s; ``"float64"`` for the exact reference of ``rounding_envelope``); with ``clip``
    the gradients are scaled as clipping by their norm scales the update."""
    lm = lm if dtype is None else replace(lm, block=replace(lm.block, dtype=dtype))

    def step(params: dict, tokens: torch.Tensor) -> tuple:
        p = {k: t.to(lm.block.torch_dtype) for k, t in params.items()}
        out = dense_lm_step(tokens, p, lm, 0.0)
        return float(out["loss"]), scale_grads(out["grads"], clip_scale(out["grad_norm"], clip))
    return step


def tp_step_fn(lm: LMConfig, prog: LMProgram = LM_CORRECT) -> StepFn:
    """``(params, tokens [S, B]) -> (rank 0's loss, unsharded grads)`` of TP ``prog`` on
    simulated ranks, parameters cut from the dense ones in ``lm``'s dtype by the program's
    ``shard`` stage; under ``prog.clip`` each rank's gradients are scaled by its own clip
    coefficient (``clip_coefs`` of the program's norm) before they are unsharded."""
    w = lm.block.world_size

    def step(params: dict, tokens: torch.Tensor) -> tuple:
        p = {k: t.to(lm.block.torch_dtype) for k, t in params.items()}
        comm = SimulatedRanks(lm.block)
        out = tp_lm_step(stack_ranks(prog.shard(p, lm)), tokens.expand(w, -1, -1), lm, comm, 0.0,
                         prog)
        coefs = clip_coefs(lm_grad_norm(out["grads"], comm, prog), w, prog.clip)
        grads = {k: torch.stack([g[r] * c for r, c in enumerate(coefs)])
                 for k, g in out["grads"].items()} if prog.clip else out["grads"]
        return float(out["losses"][0]), unshard_lm_params(unstack_ranks(grads), lm)
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


def assess(dense: dict, run: dict, envelope: torch.Tensor, margin: float) -> dict:
    """The judgement of ``run`` against ``dense`` and ``envelope`` ``[N]``: ``kind``
    (``"rounding"``, ``"bug"`` or ``"inconclusive"``), ``left`` (the first step, from 1, whose
    ``weights`` divergence exceeds ``margin`` x ``envelope`` or is NaN, if before saturation),
    ``through`` (the last step judged rounding before margin x envelope reaches the dense
    run's own ``drift``, or None) and ``text`` (``verdict``'s words)."""
    if not margin >= 1:
        raise ValueError(f"verdict: margin must be >= 1 (got {margin!r})")
    if envelope.shape != dense["losses"].shape:
        raise ValueError(f"verdict: envelope must have one value per step, shape "
                         f"{tuple(dense['losses'].shape)} (got {tuple(envelope.shape)})")
    if not bool((envelope > 0).all()):
        return {"kind": "inconclusive", "left": None, "through": None,
                "text": "inconclusive (the envelope is zero at some step: the twins' rounding "
                        "equals the reference's, as in float64)"}
    outside = (~(divergence(run, dense)["weights"] <= margin * envelope)).nonzero()  # NaN: out
    saturated = (margin * envelope >= drift(dense)).nonzero()
    first_out = int(outside[0]) if len(outside) else None
    first_sat = int(saturated[0]) if len(saturated) else None
    if first_out is not None and (first_sat is None or first_out < first_sat):
        return {"kind": "bug", "left": first_out + 1, "through": None,
                "text": f"bug from step {first_out + 1}"}
    if first_sat is not None:
        return {"kind": "inconclusive", "left": None, "through": first_sat,
                "text": f"rounding through step {first_sat}, inconclusive after (from step "
                        f"{first_sat + 1} margin x envelope reaches the training's own drift, "
                        f"so a bug could not leave it)"}
    return {"kind": "rounding", "left": None, "through": len(envelope), "text": "rounding"}


def verdict(dense: dict, run: dict, envelope: torch.Tensor, margin: float) -> str:
    """``"rounding"``, ``"bug from step n"`` (n counts updates from 1: the first step whose
    ``weights`` divergence exceeds ``margin`` x ``envelope`` ``[N]`` or is NaN), ``"rounding
    through step s, inconclusive after (reason)"`` when from step s + 1 ``margin`` x the
    envelope reaches the dense run's own ``drift``, or ``"inconclusive (reason)"``."""
    return assess(dense, run, envelope, margin)["text"]


def replayed(low: dict, replay: dict) -> dict:
    """A low-precision judgement (``assess``'s keys) completed by the float32 replay of the same
    steps: where the low-precision run stayed inside its envelope but the replay leaves its own
    (a systematic error below bfloat16's rounding), ``"bug from step n in the float32 replay"``;
    otherwise the low-precision verdict. Either way ``replay`` holds the replay's words."""
    if low["kind"] == "bug" or replay["kind"] != "bug":
        return {**low, "replay": replay["text"]}
    return {**low, "kind": "bug", "left": replay["left"], "through": None,
            "replay": replay["text"],
            "text": f"bug from step {replay['left']} in the float32 replay (inside its own "
                    f"envelope: {low['text'].split(' (')[0]})"}


def make_batches(lm: LMConfig, seed: int, steps: int) -> list[torch.Tensor]:
    """``steps`` random token batches ``[S, B]`` (own generator from ``seed``)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"make_batches: steps must be an integer >= 1 (got {steps!r})")
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lm.vocab, (lm.block.seq, lm.block.batch), generator=g)
            for _ in range(steps)]


def reference_curves(lm: LMConfig, clip: bool, params: dict, batches: list, lr: float,
                     k: int, seed: int) -> tuple:
    """``(dense, envelope)``: the dense run of ``lm`` (clipped if ``clip``) and the largest
    divergence per step ``[N]`` of ``k`` twins one rounding away (``rounding_envelope``)."""
    step, exact = dense_step_fn(lm, clip=clip), dense_step_fn(lm, "float64", clip)
    dense = train_curve(step, params, batches, lr)
    return dense, rounding_envelope(step, exact, params, batches, lr, dense, k, seed)


def judge_curves(lm: LMConfig, prog: LMProgram, params: dict, batches: list, lr: float,
                 k: int, margin: float, seed: int, reference: tuple | None = None) -> dict:
    """TP ``prog`` trained on ``batches`` against the dense run and its envelope (``k`` twins;
    clipped as ``prog.clip``): ``dense``, ``envelope`` ``[N]``, ``run``, ``divergence``
    ``[N]``, ``ratio`` ``[N]`` (divergence / envelope) and ``assess``'s keys. ``reference``
    ``(dense, envelope)`` reuses an earlier call's."""
    if reference is None:
        reference = reference_curves(lm, prog.clip, params, batches, lr, k, seed)
    dense, envelope = reference
    run = train_curve(tp_step_fn(lm, prog), params, batches, lr)
    div = divergence(run, dense)["weights"]
    return {"dense": dense, "envelope": envelope, "run": run, "divergence": div,
            "ratio": div / envelope, **assess(dense, run, envelope, margin)}
