"""The dense decoder LM: token ids ``[S, B]`` -> logits ``[S, B, V]``, each layer the book's
attention block then ``x + SwiGLU(RMSNorm(x))``; loss the mean next-token cross-entropy."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpattn.block.dense import dense_forward
from tpattn.block.layers import rms_norm
from tpattn.block.params import clone_trainable
from tpattn.block.sgd import sgd_step
from tpattn.parallel.collectives import at_least_float32
from tpattn.parallel.engine import MAX_GRAD_NORM
from .config import LMConfig
from .params import head_weight, layer_params

__all__ = ["swiglu", "lm_logits", "lm_forward", "lm_loss", "dense_lm_step"]


def swiglu(n: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """``down(silu(gate n) * up n)`` plus down's bias ``b_down`` if ``p`` has one: n
    ``[S, B, hidden]`` -> ``[S, B, hidden]``."""
    h = F.silu(F.linear(n, p["w_gate"])) * F.linear(n, p["w_up"])
    return F.linear(h, p["w_down"], p.get("b_down"))


def lm_logits(x: torch.Tensor, p: dict[str, torch.Tensor], lm: LMConfig) -> torch.Tensor:
    """The layers, final norm and head on embeddings x ``[S, B, hidden]`` -> ``[S, B, V]``."""
    eps = lm.block.eps
    for i in range(lm.layers):
        layer = layer_params(p, i)
        x = dense_forward(x, layer, lm.block)
        x = x + swiglu(rms_norm(x, layer["mlp_norm"], eps), layer)
    return F.linear(rms_norm(x, p["norm"], eps), head_weight(p, lm))


def lm_forward(tokens: torch.Tensor, p: dict[str, torch.Tensor], lm: LMConfig) -> torch.Tensor:
    """Token ids ``[S, B]`` -> logits ``[S, B, V]``."""
    return lm_logits(F.embedding(tokens, p["embed"]), p, lm)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of position s's logits ``[S, B, V]`` against token s + 1 ``[S, B]``,
    label-smoothed by ``smoothing`` (``F.cross_entropy``'s), in at least float32 (as the
    vocabulary-parallel one)."""
    logits = at_least_float32(logits[:-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[1:].reshape(-1),
                           label_smoothing=smoothing)


def dense_lm_step(tokens: torch.Tensor, base: dict[str, torch.Tensor], lm: LMConfig,
                  lr: float, clip: bool = False) -> dict:
    """One SGD step from a copy of ``base`` on tokens ``[S, B]`` (clipped by the gradient norm
    if ``clip``): ``output`` (logits), ``loss``, ``input_grad`` (at the embeddings
    ``[S, B, hidden]``), ``grads``, ``weights``, ``grad_norm`` (float64 sum of squares)."""
    p = clone_trainable(base)
    x = F.embedding(tokens, p["embed"])
    x.retain_grad()
    logits = lm_logits(x, p, lm)
    loss = lm_loss(logits, tokens, lm.label_smoothing)
    loss.backward()
    grads = {k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in p.items()}
    norm = float(sum(g.double().pow(2).sum() for g in grads.values()) ** 0.5)
    scale = min(1.0, MAX_GRAD_NORM / (norm + 1e-6)) if clip else 1.0
    return {"output": logits.detach(), "loss": loss.detach(), "input_grad": x.grad,
            "grads": grads, "weights": sgd_step(p, grads, lr, scale), "grad_norm": norm}
