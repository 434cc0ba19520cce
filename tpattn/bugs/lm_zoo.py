"""The decoder LM's bug zoo: every mode ``--model lm`` accepts, as an ``LMBugMode`` of
``LM_REGISTRY``, each a substitution of one stage of the correct ``LMProgram``."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from tpattn.model.config import LMConfig
from tpattn.model.params import MLP_BIAS, shard_lm_params
from tpattn.model.tp import LM_CORRECT, MLP_G_LABEL, LMProgram
from tpattn.check.measures import MEASURES
from tpattn.parallel.collectives import (VocabParallelCrossEntropy, vocab_offsets,
                                         vocab_parallel_ce)
from .zoo import FIDELITIES

__all__ = ["LMBugMode", "LM_REGISTRY", "LM_EQUIVALENCE", "skipped_collective", "lm_program",
           "lm_mode_names", "lm_case", "GatherVocab", "ce_on_gathered_logits", "same_draw_shards",
           "local_mean_logit", "LocalSmoothingCrossEntropy", "local_grad_norm",
           "unmasked_lookup", "owner_only_ce", "scaled_bias_before_g", "GATHER_LOGITS_LABEL",
           "SHARE_LOSS_LABEL", "SMOOTHING"]

#: The correct LM's mode name.
LM_EQUIVALENCE = "lm_equivalence"


def skipped_collective(t: torch.Tensor, comm, label: str = "") -> torch.Tensor:
    """A dropped LM collective (an f or a g): ``t`` as it is, nothing on the ledger."""
    return t


@dataclass(frozen=True)
class LMBugMode:
    """One LM mode: ``program`` the correct ``LMProgram`` with the bug's stage substituted,
    ``citation`` the public report(s), ``fidelity`` one of ``FIDELITIES``, ``fidelity_note``
    what the report showed and where this differs, ``fails`` the ``MEASURES`` it fails,
    ``setup`` the ``LMConfig`` fields it runs with (the bug is inert without them); its correct
    twin (``twin``) runs with the same setup and clip."""

    name: str
    description: str
    program: LMProgram
    citation: str | None = None
    fidelity: str = "no report"
    fidelity_note: str = ""
    fails: tuple[str, ...] = ()
    setup: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fidelity not in FIDELITIES:
            raise ValueError(f"LMBugMode {self.name}: fidelity must be one of {FIDELITIES} "
                             f"(got {self.fidelity!r})")
        known = {f.name for f in fields(LMConfig)} - {"block"}
        if not set(self.setup) <= known:
            raise ValueError(f"LMBugMode {self.name}: setup's keys must be LMConfig fields "
                             f"{sorted(known)} (got {sorted(self.setup)})")

    def config(self, lm: LMConfig) -> LMConfig:
        """``lm`` with ``setup`` applied: the shape this mode (and its twin) runs on."""
        return replace(lm, **self.setup)

    def twin(self) -> LMProgram:
        """The correct program this mode is compared with: ``LM_CORRECT``, clipped iff it is."""
        return replace(LM_CORRECT, clip=self.program.clip)

    def as_dict(self) -> dict:
        """What ``--model lm --list-modes`` prints for this mode."""
        return {"name": self.name, "description": self.description, "citation": self.citation,
                "fidelity": self.fidelity, "fidelity_note": self.fidelity_note,
                "fails": list(self.fails), "setup": dict(self.setup),
                "clip": self.program.clip}


def _bug(name: str, **stages) -> LMProgram:
    """``LM_CORRECT`` with ``stages`` replaced, named ``name``."""
    return replace(LM_CORRECT, name=name, **stages)


#: The measures a bug fails: the three of the backward and the step, or all five.
GRADS = MEASURES[2:]
ALL = MEASURES
#: The loss on, after the forward: L, dX, dW, W+.
AFTER_FORWARD = MEASURES[1:]
#: The parameter gradients and the step only: dW, W+.
PARAM_GRADS = MEASURES[3:]
#: ``ce_label_smoothing_local``'s smoothing (Megatron-LM#7464's repro uses 0.1).
SMOOTHING = 0.1
GATHER_LOGITS_LABEL = "all-gather of the logits along the vocabulary"
SHARE_LOSS_LABEL = "all-reduce of the target owners' token losses (outside autograd)"


# --- the stage substitutions, one per mode ------------------------------------------------

class GatherVocab(torch.autograd.Function):
    """Megatron's ``gather_from_tensor_model_parallel_region`` on the logits: ``[R, S, B, V/W]``
    -> ``[R, S, B, V]`` (all-gather); backward each rank keeps its own slice."""

    @staticmethod
    def forward(ctx, logits, comm):
        ctx.comm, ctx.v = comm, logits.shape[-1]
        comm.record("forward", GATHER_LOGITS_LABEL, "all_gather", op=None)
        return comm.group_cat(logits, -1, "tp")

    @staticmethod
    def backward(ctx, grad):
        v = ctx.v
        return torch.stack([grad[i, ..., r * v:(r + 1) * v]
                            for i, r in enumerate(ctx.comm.ranks)]), None


def ce_on_gathered_logits(logits, target, comm, smoothing=0.0):
    """The bug: logits gathered to the whole vocabulary, then handed to the vocabulary-parallel
    CE as if each rank held a slice; the sum of exponentials counts V W times: loss + log W."""
    full = GatherVocab.apply(logits, comm)
    return VocabParallelCrossEntropy.apply(full, target, comm, smoothing)


def same_draw_shards(p: dict, lm: LMConfig) -> list[dict]:
    """The bug: every rank's split weights the same draw (rank 0's slice on every rank), as
    when each TP rank initialises its shard from the same seed."""
    first = shard_lm_params(p, lm)[0]
    return [dict(first) for _ in range(lm.block.world_size)]


def local_mean_logit(shifted: torch.Tensor, comm) -> tuple[torch.Tensor, int]:
    """The bug: label smoothing's mean logit over the rank's own slice, and its size as ``V``;
    no all-reduce."""
    return shifted.mean(-1), shifted.shape[-1]


class LocalSmoothingCrossEntropy(VocabParallelCrossEntropy):
    """``VocabParallelCrossEntropy`` with ``local_mean_logit``: every rank a different loss."""

    @staticmethod
    def forward(ctx, logits, target, comm, smoothing=0.0):
        return vocab_parallel_ce(ctx, logits, target, comm, smoothing, local_mean_logit)


def local_grad_norm(grads: dict, comm, prog: LMProgram) -> torch.Tensor:
    """The bug: each rank's norm of the gradients it holds ``[R]``, no all-reduce, so each
    rank clips by its own coefficient."""
    return sum(g.double().pow(2).flatten(1).sum(1) for g in grads.values()).sqrt()


def owner_only_ce(logits, target, comm, smoothing=0.0):
    """The bug: each token's loss kept on the rank owning its target, shared by an all-reduce
    outside autograd: every rank's value right, its gradient only where it owns the target."""
    loss = VocabParallelCrossEntropy.apply(logits, target, comm, smoothing)
    local = target - vocab_offsets(comm, logits.shape[-1])
    mine = torch.where((local >= 0) & (local < logits.shape[-1]), loss, 0.0)
    comm.record("forward", SHARE_LOSS_LABEL)
    shared = comm.group_sum(mine.detach(), "tp")  # like torch.distributed.all_reduce
    return mine + (shared - mine.detach())


def unmasked_lookup(tokens: torch.Tensor, embed: torch.Tensor, comm) -> torch.Tensor:
    """The bug: ``vocab_parallel_lookup`` without zeroing the rows of tokens outside the rank's
    slice, so every other rank adds its local row 0 to each token."""
    v = embed.shape[1]
    local = tokens - vocab_offsets(comm, v)
    owned = (local >= 0) & (local < v)
    return embed[torch.arange(embed.shape[0]).view(-1, 1, 1), torch.where(owned, local, 0)]


def scaled_bias_before_g(partial: torch.Tensor, p: dict, comm, g) -> torch.Tensor:
    """The bug: each rank adds ``b_down / W`` ``[R, hidden]`` to its partials
    ``[R, S, B, hidden]`` before ``g``, the division inside autograd: the sum holds one bias,
    but each replica's bias gradient is the summed dy divided by W (nothing sums it back);
    ``g`` of the partials alone without a bias."""
    if MLP_BIAS not in p:
        return g(partial, comm, MLP_G_LABEL)
    scaled = p[MLP_BIAS].unsqueeze(1).unsqueeze(1) / comm.world_size
    return g(partial + scaled, comm, MLP_G_LABEL)

#: name -> LMBugMode, in listing order.
LM_REGISTRY: dict[str, LMBugMode] = {m.name: m for m in [
    LMBugMode(LM_EQUIVALENCE, "correct TP for the whole LM", LM_CORRECT, fidelity="correct",
              fidelity_note="not a bug: the correct program every other LM mode is compared "
              "with"),
    LMBugMode("embed_reduce_missing",
              "the vocabulary-parallel embedding's g dropped: each rank keeps the rows of its "
              "own slice", _bug("embed_reduce_missing", embed_g=skipped_collective),
              fails=ALL, fidelity_note="the embedding's twin of the block's dropped g; no "
              "public report is cited"),
    LMBugMode("mlp_output_reduce_missing",
              "the MLP's g dropped: each rank's MLP output is its own partial",
              _bug("mlp_output_reduce_missing", mlp_g=skipped_collective), fails=ALL,
              fidelity_note="the block's missing g, in the MLP; no public report is cited"),
    LMBugMode("mlp_input_grad_reduce_missing",
              "the MLP's f dropped: its dn keeps one rank's contribution",
              _bug("mlp_input_grad_reduce_missing", mlp_f=skipped_collective), fails=GRADS,
              fidelity_note="the block's missing f, in the MLP; no public report is cited"),
    LMBugMode("head_input_grad_reduce_missing",
              "the LM head's f dropped: the final norm's dn keeps one rank's vocabulary slice",
              _bug("head_input_grad_reduce_missing", head_f=skipped_collective),
              fails=GRADS, fidelity_note="the column-parallel head's missing f; no public "
              "report is cited"),
    LMBugMode("ce_on_gathered_logits",
              "the logits all-gathered to the whole vocabulary, then fed to the "
              "vocabulary-parallel cross-entropy as if a slice: the loss is off by log W",
              _bug("ce_on_gathered_logits", cross_entropy=ce_on_gathered_logits),
              citation="NVIDIA/Megatron-LM issue 7452 (row 2)", fidelity="mechanism",
              fails=AFTER_FORWARD,
              fidelity_note="the report: GPTModel's labels path with gathered logits "
              "(parallel_output=False or runtime_gather_output) gives loss + log(TP) and wrong "
              "gradients; here the gather is a substituted CE stage, not a model flag"),
    LMBugMode("tp_init_same_seed",
              "every TP rank's split weights drawn from the same seed: each rank holds the "
              "same slice", _bug("tp_init_same_seed", shard=same_draw_shards),
              citation="modelscope/ms-swift PR 7944; InternLM/InternLM PR 405",
              fidelity="consistent", fails=ALL,
              fidelity_note="both PRs say only that TP-split tensors were initialised from "
              "the same seed on every TP rank (no diff or symptom in the thread); here every "
              "rank holds rank 0's slice of the dense draw, where a same-seed draw of a shard "
              "gives other numbers, equal on every rank all the same"),
    LMBugMode("ce_label_smoothing_local",
              "label smoothing's mean log-probability and vocabulary size taken over the "
              "rank's own slice: every rank a different loss",
              _bug("ce_label_smoothing_local", cross_entropy=LocalSmoothingCrossEntropy.apply),
              citation="NVIDIA/Megatron-LM issue 737; NVIDIA/Megatron-LM issue 7464 (fix: "
              "PR 7466, open)", fidelity="mechanism", fails=AFTER_FORWARD,
              setup={"label_smoothing": SMOOTHING},
              fidelity_note="the reports' local mean of log-probs and local V (forward and "
              "backward); the smoothing here is F.cross_entropy's (a / V on every token), "
              "Megatron's is a V / (V - 1), so its local V also enters that coefficient"),
    LMBugMode("grad_norm_local_shard",
              "the clip coefficient from each rank's own gradient norm, not the TP group's",
              _bug("grad_norm_local_shard", grad_norm=local_grad_norm, clip=True),
              citation="meta-pytorch/torchrec PR 2271 (closed); huggingface/transformers "
              "PR 36132", fidelity="consistent", fails=("post_step_weight_max_abs_diff",),
              fidelity_note="torchrec PR 2271 clips DTensor gradients by the global norm "
              "instead of the per-rank local norm; transformers PR 36132 saw grad norms differ "
              "per TP rank; neither measures a step. Related: radixark/miles_diffusion PR 35 "
              "(FSDP, only the logged norm was local)"),
    LMBugMode("embed_mask_forgotten",
              "the vocabulary-parallel embedding does not zero the rows of tokens outside the "
              "rank's slice: every other rank adds its row 0",
              _bug("embed_mask_forgotten", embed_lookup=unmasked_lookup), fails=ALL,
              fidelity_note="no public report found: the searched threads mask the input ids "
              "(out-of-range ids crash at TP 1) or fix the mask's dtype, none forgets the "
              "output mask"),
    LMBugMode("ce_target_logit_no_autograd",
              "each token's loss kept by its target's owner and shared by an all-reduce "
              "outside autograd: the other slices get no gradient from it",
              _bug("ce_target_logit_no_autograd", cross_entropy=owner_only_ce),
              citation="modelscope/ms-swift PR 9947", fidelity="consistent", fails=GRADS,
              fidelity_note="the PR: a manual target gather and a non-autograd TP all-reduce "
              "gave non-owner vocabulary shards zero or wrong logit gradients, in GRPO's "
              "log-probs; its old code is not in the thread, so the owner-only term is the "
              "simplest reading"),
    LMBugMode("row_bias_grad_scaled",
              "the MLP's replicated down bias added as b / W on every rank before g through "
              "autograd: the forward holds one bias, each rank's bias gradient is 1/W of it",
              _bug("row_bias_grad_scaled", mlp_bias=scaled_bias_before_g),
              citation="pytorch/torchtitan PR 4332 (closed, not merged); the forward from "
              "pytorch/torchtitan PR 3781", fidelity="mechanism", fails=PARAM_GRADS,
              setup={"mlp_bias": True},
              fidelity_note="reported in a closed PR (not merged): the rowwise bias / "
              "tp_degree was a differentiable division, so \"autograd also divided each local "
              "bias gradient by `tp_degree`\"; its fix is bias + (bias / tp_degree - "
              "bias).detach(). Here the bias is the SwiGLU down projection's, not a DTensor "
              "Linear's"),
]}


def lm_mode_names() -> list[str]:
    """Every LM mode name, in listing order."""
    return list(LM_REGISTRY)


def lm_program(mode: str) -> LMProgram:
    """The ``LMProgram`` of ``mode``; ``ValueError`` naming the LM modes for any other name."""
    if mode not in LM_REGISTRY:
        raise ValueError(f"mode must be one of the LM's modes {lm_mode_names()} (got {mode!r})")
    return LM_REGISTRY[mode].program


def lm_case(mode: str, lm: LMConfig) -> tuple[LMConfig, LMProgram, bool]:
    """What ``mode`` runs on ``lm``: ``(lm with the mode's setup, its LMProgram, clip)``,
    ``clip`` whether the dense twin clips by the global gradient norm as the program does;
    ``ValueError`` for a name not in ``LM_REGISTRY``. Every LM run derives its case here."""
    program = lm_program(mode)
    return LM_REGISTRY[mode].config(lm), program, program.clip
