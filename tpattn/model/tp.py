"""The decoder LM on the ranks ``comm`` holds (every tensor ``[R, ...]``, parameters stacked
shards of ``shard_lm_params``): vocabulary-parallel embedding, the book's ``rank_block`` and a
SwiGLU MLP between the same f and g, column-parallel head, vocabulary-parallel cross-entropy."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from tpattn.block.kv_layout import is_first_kv_copy
from tpattn.block.layers import rms_norm
from tpattn.parallel.collectives import (CopyToRanks, ReduceFromRanks,
                                         VocabParallelCrossEntropy, reduce_scalar, vocab_offsets)
from tpattn.parallel.engine import GRAD_NORM_LABEL, MAX_GRAD_NORM, rank_block, unstack_ranks
from tpattn.parallel.program import CORRECT, REPLICATED, Program, sgd_ranks
from .config import LMConfig
from .params import MLP_BIAS, head_weight, layer_params, shard_lm_params, unshard_lm_params

__all__ = ["EMBED_G_LABEL", "MLP_F_LABEL", "MLP_G_LABEL", "HEAD_F_LABEL", "rank_linear",
           "vocab_parallel_lookup", "mlp_bias_after_g", "LMProgram", "LM_CORRECT",
           "tp_lm_embed", "rank_swiglu",
           "tp_lm_logits", "tp_lm_losses", "tp_lm_step", "gather_vocab", "gather_lm_step",
           "LM_REPLICATED", "lm_grad_squares", "lm_global_grad_norm", "lm_grad_norm",
           "clip_coefs"]

EMBED_G_LABEL = "g: all-reduce of the embedding partials"
MLP_F_LABEL = "f: all-reduce of the MLP's dn"
MLP_G_LABEL = "g: all-reduce of the MLP's output partials"
HEAD_F_LABEL = "f: all-reduce of the LM head's dn"
#: The LM's parameters every TP rank holds whole, by short name: counted once in the norm.
LM_REPLICATED = REPLICATED + ("mlp_norm", MLP_BIAS)


def rank_linear(n: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each rank's ``F.linear``: n ``[R, S, B, in]``, w ``[R, out, in]`` -> ``[R, S, B, out]``."""
    return torch.matmul(n, w.transpose(1, 2).unsqueeze(1))


def vocab_parallel_lookup(tokens: torch.Tensor, embed: torch.Tensor, comm) -> torch.Tensor:
    """Each rank's rows of tokens ``[R, S, B]`` in its slice embed ``[R, V/W, hidden]``, zero
    for tokens outside it: the partials ``[R, S, B, hidden]`` g sums."""
    v = embed.shape[1]
    local = tokens - vocab_offsets(comm, v)
    owned = (local >= 0) & (local < v)
    rows = embed[torch.arange(embed.shape[0]).view(-1, 1, 1), torch.where(owned, local, 0)]
    return torch.where(owned.unsqueeze(-1), rows, 0.0)


def mlp_bias_after_g(partial: torch.Tensor, p: dict, comm, g: Callable) -> torch.Tensor:
    """The MLP's output: ``g`` of the down projection's partials ``[R, S, B, hidden]``, plus
    the replicated bias ``b_down`` ``[R, hidden]`` once after it if ``p`` has one (Megatron's
    ``RowParallelLinear``: bias after the reduce)."""
    out = g(partial, comm, MLP_G_LABEL)
    return out + p[MLP_BIAS].unsqueeze(1).unsqueeze(1) if MLP_BIAS in p else out


def lm_grad_squares(grads: dict[str, torch.Tensor], comm) -> torch.Tensor:
    """Each rank's squared gradients summed, ``[R]`` float64: ``LM_REPLICATED`` ones on TP rank
    0 only, replicated wk/wv on the first rank of their replica group only."""
    counted = {"replicated": torch.tensor(comm.ranks) == 0,
               "kv": torch.tensor([is_first_kv_copy(comm.cfg, r) for r in comm.ranks]),
               "sharded": torch.ones(len(comm.ranks), dtype=torch.bool)}
    squares = torch.zeros(len(comm.ranks), dtype=torch.float64)
    for key, g in grads.items():
        name = key.rsplit(".", 1)[-1]
        kind = ("replicated" if name in LM_REPLICATED
                else "kv" if name in ("wk", "wv") else "sharded")
        squares += g.double().pow(2).flatten(1).sum(1) * counted[kind]
    return squares


def lm_global_grad_norm(grads: dict[str, torch.Tensor], comm,
                        prog: "LMProgram") -> torch.Tensor:
    """The global gradient norm of stacked ``grads``: ``prog.grad_squares`` summed over the TP
    group (one all-reduce), square-rooted; a scalar."""
    return reduce_scalar(prog.grad_squares(grads, comm), comm, GRAD_NORM_LABEL).sqrt()


@dataclass(frozen=True)
class LMProgram:
    """The LM's TP stages around the blocks' ``Program``; the defaults are correct TP, a bug
    replaces one stage. ``shard(p, lm)`` cuts the dense parameters into one dict per rank;
    ``mlp_bias(partial, p, comm, g)`` turns the MLP's partials into its output through the
    ``mlp_g`` stage ``g``;
    ``cross_entropy(logits, target, comm, smoothing)`` is the per-token loss; ``grad_norm(grads,
    comm, prog)`` the norm ``clip`` scales by (a scalar, or ``[R]`` one per rank)."""

    block: Program = CORRECT
    shard: Callable = shard_lm_params
    embed_lookup: Callable = vocab_parallel_lookup
    embed_g: Callable = ReduceFromRanks.apply
    mlp_f: Callable = CopyToRanks.apply
    mlp_g: Callable = ReduceFromRanks.apply
    mlp_bias: Callable = mlp_bias_after_g
    head_f: Callable = CopyToRanks.apply
    cross_entropy: Callable = VocabParallelCrossEntropy.apply
    grad_squares: Callable = lm_grad_squares
    grad_norm: Callable = lm_global_grad_norm
    clip: bool = False
    name: str = field(default="correct", compare=False)


#: Correct TP for the LM.
LM_CORRECT = LMProgram()


def tp_lm_embed(tokens: torch.Tensor, p: dict, comm,
                prog: LMProgram = LM_CORRECT) -> torch.Tensor:
    """Tokens ``[R, S, B]`` -> embeddings ``[R, S, B, hidden]``, the same on every TP rank."""
    return prog.embed_g(prog.embed_lookup(tokens, p["embed"], comm), comm, EMBED_G_LABEL)


def rank_swiglu(x: torch.Tensor, p: dict, lm: LMConfig, comm,
                prog: LMProgram = LM_CORRECT) -> torch.Tensor:
    """``x + g(down(silu(gate f(n)) * up f(n))) (+ b_down)``, ``n = RMSNorm(x)``: x
    ``[R, S, B, hidden]``, gate/up rows and down columns of each rank's ffn slice; g and the
    bias through ``prog.mlp_bias``."""
    n = rms_norm(x, p["mlp_norm"].unsqueeze(1).unsqueeze(1), lm.block.eps)  # replicated
    n = prog.mlp_f(n, comm, MLP_F_LABEL)
    h = F.silu(rank_linear(n, p["w_gate"])) * rank_linear(n, p["w_up"])
    return x + prog.mlp_bias(rank_linear(h, p["w_down"]), p, comm, prog.mlp_g)


def tp_lm_logits(x: torch.Tensor, p: dict, lm: LMConfig, comm,
                 prog: LMProgram = LM_CORRECT) -> torch.Tensor:
    """Embeddings x ``[R, S, B, hidden]`` -> each rank's vocabulary slice of the logits
    ``[R, S, B, V/W]``: the layers, final norm, f, the column-parallel head."""
    for i in range(lm.layers):
        layer = layer_params(p, i)
        x = rank_block(x, layer, lm.block, prog.block, comm)
        x = rank_swiglu(x, layer, lm, comm, prog)
    n = rms_norm(x, p["norm"].unsqueeze(1).unsqueeze(1), lm.block.eps)
    return rank_linear(prog.head_f(n, comm, HEAD_F_LABEL), head_weight(p, lm))


def tp_lm_losses(logits: torch.Tensor, tokens: torch.Tensor, comm,
                 prog: LMProgram = LM_CORRECT, smoothing: float = 0.0) -> torch.Tensor:
    """Every rank's mean next-token loss ``[R]``, label-smoothed by ``smoothing``: logits
    ``[R, S, B, V/W]``, tokens ``[R, S, B]``."""
    return prog.cross_entropy(logits[:, :-1], tokens[:, 1:], comm, smoothing).mean(dim=(1, 2))


def lm_grad_norm(grads: dict[str, torch.Tensor], comm,
                 prog: LMProgram = LM_CORRECT) -> torch.Tensor:
    """``prog.grad_norm`` of stacked ``grads``: a scalar (correct), or one per rank ``[R]``."""
    return prog.grad_norm(grads, comm, prog)


def clip_coefs(norm: torch.Tensor, ranks: int, clip: bool) -> list[float]:
    """Every rank's update scale: ``min(1, MAX_GRAD_NORM / (norm + 1e-6))`` if ``clip``, else 1;
    ``norm`` a scalar (every rank's) or ``[ranks]`` (one each)."""
    norms = torch.as_tensor(norm).reshape(-1).expand(ranks)
    return [min(1.0, MAX_GRAD_NORM / (float(n) + 1e-6)) if clip else 1.0 for n in norms]


def tp_lm_step(p: dict[str, torch.Tensor], tokens: torch.Tensor, lm: LMConfig, comm, lr: float,
               prog: LMProgram = LM_CORRECT) -> dict:
    """One SGD step on ``comm``'s ranks (each backpropagates its own loss), clipped by
    ``prog.grad_norm`` under ``prog.clip``: p stacked, tokens ``[R, S, B]`` -> ``outputs``
    ``[R, S, B, V/W]``, ``losses`` ``[R]``, ``input_grads`` (at the embeddings
    ``[R, S, B, hidden]``), ``grads``, ``weights`` (stacked), ``grad_norm`` (rank 0's),
    ``ledger``."""
    ps = {k: t.detach().clone().requires_grad_(True) for k, t in p.items()}
    x = tp_lm_embed(tokens, ps, comm, prog)
    x.retain_grad()
    logits = tp_lm_logits(x, ps, lm, comm, prog)
    losses = tp_lm_losses(logits, tokens, comm, prog, lm.label_smoothing)
    losses.sum().backward()
    grads = {k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in ps.items()}
    norm = lm_grad_norm(grads, comm, prog)
    coefs = clip_coefs(norm, x.shape[0], prog.clip)
    return {"outputs": logits.detach(), "losses": losses.detach(), "input_grads": x.grad,
            "grads": grads, "weights": sgd_ranks(ps, grads, lr, coefs, comm),
            "grad_norm": float(norm.reshape(-1)[0]), "ledger": comm.ledger}


def gather_vocab(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """TP group 0's vocabulary slices ``[R, ..., V/W]`` joined in rank order: ``[..., V]``."""
    return torch.cat(list(t[:world_size]), dim=-1)


def gather_lm_step(step: dict, lm: LMConfig) -> dict:
    """``tp_lm_step``'s dict as ``dense_lm_step``'s: logits gathered, parameters and gradients
    unsharded; ``loss`` ``[R]`` and ``input_grad`` ``[R, S, B, hidden]`` every rank's."""
    w = lm.block.world_size
    return {"output": gather_vocab(step["outputs"], w), "loss": step["losses"],
            "input_grad": step["input_grads"], "grad_norm": step["grad_norm"],
            "grads": unshard_lm_params(unstack_ranks(step["grads"]), lm),
            "weights": unshard_lm_params(unstack_ranks(step["weights"]), lm)}
