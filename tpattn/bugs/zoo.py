"""The bug zoo: a registry of tensor-parallel bugs, each one injectable, and how faithfully
each reproduces a public report.

Every entry of ``REGISTRY`` is a ``BugMode``: a name (a valid ``--mode``), a description, its
``Injection`` (the knob of the sharded block it turns: ``Injection.program`` makes it one
substituted stage), the public report, its ``fidelity`` and what it ``needs`` (``NEEDS``: a
predicate of the ``Config`` each). Every mode ``tpattn.run`` accepts is an entry here, the
original fixture's three included; ``register`` adds modes from other modules. Only
``"mechanism"`` entries (``reported_modes()``) count as reproduced reported bugs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tpattn.block.kv_layout import kv_grad_bug_applies
from tpattn.check.core import (ALL_MODES, BIAS_SEED_OFFSET, EQUIVALENCE, MISSING_INPUT_GRAD_REDUCE,
                               MISSING_KV_GRAD_REDUCE, MISSING_NORM_GRAD_REDUCE,
                               MISSING_OUTPUT_REDUCE, MODES, NORM_GRAD_AVERAGED,
                               OTHER_BATCH_SEED_OFFSET, SP_MODES, block_inputs, check_seed,
                               clip_coef, dense_step, dropout_masks,
                               load_rank_shard, make_inputs, make_params, rank_batches,
                               shard, unshard)
from tpattn.check.core import tp_step
from tpattn.config import Config
from tpattn.parallel.engine import MAX_GRAD_NORM, REPLICATED
from tpattn.parallel.wrong import ScaleGrad as GradScale
from tpattn.parallel.injection import Injection
from tpattn.parallel.one_graph import one_graph_forward

__all__ = ["Injection", "BugMode", "REGISTRY", "FIDELITIES", "register", "get_mode",
           "mode_names", "list_modes", "runnable_modes", "reported_modes",
           "check_needs", "check_mode", "modes_for", "tp_side",
           "make_params", "shard", "unshard", "load_rank_shard", "sides", "forward_fixture",
           "block_inputs", "LAYOUT_NEEDS", "MESH_NEEDS", "NEEDS", "MODEL_OPTION_NEEDS",
           "AROUND_THE_BLOCK",
           "GradScale", "MAX_GRAD_NORM", "REPLICATED", "BIAS_SEED_OFFSET", "OTHER_BATCH_SEED_OFFSET",
           "rank_batches", "dense_step", "clip_coef"]

#: How faithfully an entry reproduces its public report. ``"mechanism"``: the report's
#: mechanism, at its place; ``"consistent"``: the simplest mechanism consistent with a report
#: whose thread establishes no root cause; ``"no report"``: no public report found (a plausible
#: bug); ``"correct"``: not a bug (``equivalence``). An entry has a citation iff its fidelity is
#: ``"mechanism"`` or ``"consistent"``.
FIDELITIES = ("mechanism", "consistent", "no report", "correct")
#: The ``needs`` that name a layout of the ``Config`` rather than a setup: the mode's injection
#: exists only there (``check.core.check_mode`` states the rule) and runs on the engine's
#: ranks and in the fixture's one-graph view alike.
LAYOUT_NEEDS = ("sequence_parallel", "kv_heads < world_size", "dropout > 0", "qk_norm",
                "data_parallel >= 2", "data_parallel == world_size")
#: The needs of the TP x DP mesh's modes (``Config.data_parallel``): they run on any layout
#: the engine's mesh runs (plain TP, sequence parallelism, replicated KV heads).
MESH_NEEDS = ("data_parallel >= 2", "data_parallel == world_size")
#: The modes of the chapter "Around the block" that run on plain-TP shapes: a fused QKV
#: checkpoint loaded into ranks. ``runnable_modes()`` leaves them out, as it leaves out the
#: layout modes, so the earlier chapters' hunts, tables and exercises and the earlier
#: held-out figures keep their cases; ``tpattn.diagnosis.evaluate.HELD_OUT`` hosts them on
#: shapes of their own.
AROUND_THE_BLOCK = ("qkv_loaded_from_rank0", "grouped_qkv_read_as_plain")


def _met(cfg: Config) -> bool:
    """A need the mode's own setup meets (``bias``, ``grad_clip``, ``fused_qkv``)."""
    return True


#: Each ``needs`` condition as a predicate of the ``Config`` (a need not listed: ``_met``).
NEEDS = {"world_size >= 2": lambda cfg: cfg.world_size >= 2,
         "sequence_parallel": lambda cfg: cfg.sequence_parallel,
         "kv_heads >= 2 * world_size": lambda cfg: cfg.kv_heads >= 2 * cfg.world_size,
         "query_heads > kv_heads": lambda cfg: cfg.query_heads > cfg.kv_heads,
         "kv_heads < world_size": lambda cfg: cfg.kv_heads < cfg.world_size,
         "data_parallel >= 2": lambda cfg: cfg.data_parallel >= 2,
         "data_parallel == world_size": lambda cfg: cfg.data_parallel == cfg.world_size,
         "dropout > 0": lambda cfg: cfg.dropout > 0, "qk_norm": lambda cfg: cfg.qk_norm,
         "bias": _met, "grad_clip": _met, "fused_qkv": _met}
#: The needs that are a model option of the ``Config`` (``--dropout P``, ``--qk-norm``).
MODEL_OPTION_NEEDS = ("dropout > 0", "qk_norm")


@dataclass(frozen=True)
class BugMode:
    """One entry of the registry.

    ``injection``: the sharded program (``None``: listed, not runnable). ``needs``:
    conditions on the setup or the layout (``LAYOUT_NEEDS``),
    as text (checked by ``check_needs``). ``citation``: the public report(s), ``"owner/repo
    issue N"`` style text. ``fidelity``: one of ``FIDELITIES``; ``fidelity_note``: one line
    saying what the cited thread showed and where the reproduction differs (or why there is
    no citation).
    """

    name: str
    description: str
    citation: str | None
    needs: tuple[str, ...] = ()
    injection: Injection | None = None
    provider: str = "tpattn.bugs.zoo"
    how: str = ""
    fix: str = ""
    fidelity: str = "no report"
    fidelity_note: str = ""

    @property
    def is_correct(self) -> bool:
        """True when the entry's program is correct TP: its injection is its own bug-free
        twin (``Injection.correct``), as ``equivalence``'s is."""
        return self.injection is not None and self.injection == self.injection.correct()

    def as_dict(self) -> dict:
        """What ``--list-modes`` prints for this mode: name, description, citation,
        fidelity, fidelity_note, needs, provider, ``runnable`` (``tpattn.run`` can run it)
        and ``observable`` (``tpattn.observe`` can watch it, on a ``Config`` that meets its
        ``needs``): both mean the entry has an injection."""
        return {"name": self.name, "description": self.description, "citation": self.citation,
                "fidelity": self.fidelity, "fidelity_note": self.fidelity_note,
                "needs": list(self.needs), "provider": self.provider,
                "runnable": self.injection is not None,
                "observable": self.injection is not None}


def _entries() -> list[BugMode]:
    """Every registry mode of one TP group, in listing order."""
    return _reduction_entries() + _setup_entries() + _layout_entries() + _model_entries()


def _reduction_entries() -> list[BugMode]:
    """Correct TP and the bugs of f and g themselves."""
    return [
        BugMode(EQUIVALENCE, "correct TP: g sums the output partials, f sums dn", None,
                injection=Injection(), how="both reductions", fix="-",
                fidelity="correct",
                fidelity_note="not a bug: the correct program every other mode is compared with"),
        BugMode(MISSING_OUTPUT_REDUCE, "g dropped: each rank's output is its own partial", None,
                ("world_size >= 2",), Injection(g=0),
                how="no forward all-reduce of partials",
                fix="all-reduce the row-parallel output (g) before the residual",
                fidelity_note="the book's own bug (chapter 8); no public report is cited"),
        BugMode(MISSING_INPUT_GRAD_REDUCE, "f dropped: dn keeps one rank's contribution",
                "bigcode-project/Megatron-LM PR 36 (fixes issue 35); "
                "NVIDIA/Megatron-LM PR 6839 (open)",
                ("world_size >= 2",), Injection(f="none"),
                how="no backward all-reduce of dn",
                fix="all-reduce dn in backward (f, copy_to_tensor_model_parallel_region)",
                fidelity="mechanism",
                fidelity_note="bigcode PR 36: MQA's K/V projection, replicated over TP, lacked "
                "the input-gradient all-reduce ColumnLinear does, so the loss exploded at TP 2 "
                "with the weights in sync (issue 35); Megatron-LM PR 6839: MLA's shared K-RoPE "
                "gradient summed over local heads only, fixed with "
                "copy_to_tensor_model_parallel_region; there one branch missed f, here all of "
                "dn (chapter 9)"),
        BugMode("input_grad_reduce_averaged",
                "f averages dn over the ranks instead of summing it", None,
                ("world_size >= 2",), Injection(f="mean"),
                how="backward all-reduce with op AVG (sum / W): the ledger shows op avg where "
                    "the plan has sum (real ranks issue SUM, then / W, and record avg)",
                fix="reduce with SUM: every rank's share of dn is a different term",
                fidelity_note="no public report of f averaging dn was found; "
                "EleutherAI/gpt-neox PR 1259 averaged the sequence-parallel LayerNorm "
                "weight-gradient hook (dX unaffected), which is norm_grad_averaged, not this"),
        BugMode("input_grad_reduced_twice",
                "dn all-reduced twice: replicated gradients come out W times too large",
                "modelscope/mcore-bridge PR 101; NVIDIA/Megatron-LM issue 1528 (open)",
                ("world_size >= 2",), Injection(f="twice"),
                how="two backward all-reduces of dn (f and an extra dgrad all-reduce)",
                fix="reduce dn once: drop the second all-reduce", fidelity="consistent",
                fidelity_note="mcore-bridge PR 101: OLMoE's q/k norms act on the gathered, "
                "TP-replicated tensor, so each rank already holds their full gradient, yet the "
                "name-matched qk-layernorm gradient all-reduce summed it again (x tp_size); "
                "issue 1528 (open, no root cause) sees the LayerNorm weight gradient TP size "
                "times too large only with FP8 + TP + CP; the zoo sums dn twice, so the norm "
                "weight gradient is W times too large and dX is wrong too"),
        BugMode("output_reduced_twice",
                "g applied twice: the output is W times the sum of the partials", None,
                ("world_size >= 2",), Injection(g=2),
                how="two forward all-reduces of the output partials",
                fix="all-reduce the partials once",
                fidelity_note="no public report found: the forward twin of "
                "input_grad_reduced_twice, a plausible bug"),
    ]


def _setup_entries() -> list[BugMode]:
    """The bugs of the step and of loading: the norm, the bias, the fused checkpoint."""
    return [
        BugMode("grad_norm_counts_replicas",
                "replicated parameters counted W times in the global gradient norm "
                "(clipping wrong, every gradient right)",
                "NVIDIA-NeMo/RL PR 3788 (open); ROCm/TransformerEngine PR 715",
                ("grad_clip", "world_size >= 2"), Injection(norm="per_rank", clip=True),
                how="each rank adds the replicated norm's squared gradient before the sum",
                fix="count a replicated parameter on one rank only (or divide by W)",
                fidelity="mechanism",
                fidelity_note="RL PR 3788: get_grad_norm summed every parameter over the TP "
                "group, so TP-replicated q_norm/k_norm were counted tp_size times, the loss "
                "unchanged; TE PR 715: replicated weights marked tensor-parallel, counted tp_size "
                "times in Megatron's norm; the zoo counts the replicated norm weight per rank"),
        BugMode("row_bias_on_every_rank",
                "the row-parallel output bias is added on every rank before g: "
                "the output is off by (W-1)*b",
                "huggingface/text-generation-inference issue 1036; Wenyueh/MinivLLM issue 80",
                ("bias", "world_size >= 2"), Injection(bias="every_rank"),
                how="partial_r + b on every rank, then the all-reduce",
                fix="add the bias once, after the all-reduce", fidelity="mechanism",
                fidelity_note="both report the bias of a row-parallel linear added on every "
                "rank before the all-reduce (SUM), so the output holds tp_size biases "
                "(MinivLLM measured one extra bias at tp_size 2); the zoo adds it at that place"),
        BugMode("fused_qkv_naive_split",
                "a fused [Wq; Wk; Wv] weight cut into contiguous rank slices: "
                "rank 0 gets only query rows",
                "deepspeedai/DeepSpeed PR 3844",
                ("fused_qkv", "world_size >= 2"), Injection(shard="fused_naive"),
                how="rank r takes rows [r*R/W, (r+1)*R/W) of the fused weight",
                fix="split Wq, Wk and Wv by heads separately (or interleave the fused layout "
                    "by KV group)", fidelity="mechanism",
                fidelity_note="AutoTP cut fused QKV weights whose layout it did not know (GLM: "
                "all q heads, then all k, then all v) without regard to heads: incorrect "
                "inference results, no error; the PR splits each known layout by heads (the "
                "zoo's is that GLM layout, cut into contiguous slices, in training)"),
    ]


def _layout_entries() -> list[BugMode]:
    """The bugs of the KV layout, the inputs and sequence parallelism."""
    return [
        BugMode("repeat_kv_tiled",
                "repeat_kv tiles the KV heads instead of interleaving them: query heads "
                "read the wrong KV head",
                "onnx/onnx PR 7274 (open); ekzhang/jax-js PR 180",
                ("kv_heads >= 2 * world_size", "query_heads > kv_heads"), Injection(kv="tile"),
                how="k.repeat(1, 1, groups, 1) on each rank instead of repeat_interleave",
                fix="repeat_interleave: query head h reads KV head h // groups",
                fidelity="mechanism",
                fidelity_note="a GQA layout bug independent of TP, reported on one device: "
                "ONNX's Attention op and jax-js tiled the KV heads ([h0, h1, h0, h1]) where "
                "torch repeat-interleaves; not a TP report: the zoo injects it on each rank's "
                "local KV heads, visible once a rank holds two"),
        BugMode("inputs_not_replicated",
                "each TP rank draws its own batch (the batches of a TP group differ)",
                "deepspeedai/DeepSpeed issue 7199", ("world_size >= 2",),
                Injection(inputs="per_rank"),
                how="rank r >= 1 trains on a batch from a different seed",
                fix="broadcast the batch from TP rank 0 (or seed the loader identically)",
                fidelity="consistent",
                fidelity_note="DeepSpeed's AutoTP check stopped an HF Trainer run with 'Data "
                "inconsistency within the TP group'; the thread gives no root cause. Not "
                "bigscience-workshop/Megatron-DeepSpeed PR 276: there the data were identical "
                "and the CPU generator's state (torch_rng_state) desynced (the loader's seed "
                "consumed a draw on tp_rank 0 only), and nn.Dropout of CPU tensors with it: "
                "that one is dropout_rng_desync"),
        BugMode(MISSING_NORM_GRAD_REDUCE,
                "sequence parallelism without the all-reduce of the norm weight's gradient",
                "NVIDIA-NeMo/Speech PR 7184; hpcaitech/ColossalAI PR 4915",
                ("sequence_parallel",), Injection(norm_grad="none"),
                provider="tpattn.parallel.sequence_parallel",
                how="no all-reduce of the norm weight's gradient after backward",
                fix="all-reduce the norm weight's gradient over the TP group",
                fidelity="mechanism",
                fidelity_note="NeMo PR 7184: the all-reduce of sequence-parallel LayerNorm "
                "gradients looked for a 'sequence_parallel' attribute that apex's LayerNorm "
                "names 'sequence_parallel_enabled', so it was skipped; ColossalAI PR 4915 adds "
                "the missing all-reduce; tpattn.parallel.sequence_parallel drops it at that place"),
        BugMode(NORM_GRAD_AVERAGED,
                "sequence parallelism: the norm weight's gradient averaged instead of summed",
                "EleutherAI/gpt-neox PR 1259", ("sequence_parallel",),
                Injection(norm_grad="mean"),
                provider="tpattn.parallel.sequence_parallel",
                how="the norm weight's gradient all-reduced with op AVG (sum / W): the ledger "
                    "shows op avg where the plan has sum",
                fix="reduce with SUM: each rank's gradient covers different tokens",
                fidelity="mechanism",
                fidelity_note="the SP LayerNorm gradient hook averaged over the sequence "
                "shards instead of summing (and was registered before deepspeed.initialize); "
                "the PR sums, and says it does not fix the run's convergence issue, whose "
                "slowly changing LayerNorm weights it reports as still open"),
    ]


def _model_entries() -> list[BugMode]:
    """The bugs of the KV replicas and the model options (dropout, qk-norm)."""
    return [
        BugMode(MISSING_KV_GRAD_REDUCE,
                "replicated KV heads without the all-reduce of their gradients",
                "bigcode-project/Megatron-LM issue 11; fixed by PR 12",
                ("kv_heads < world_size",), Injection(kv_grad="none"),
                provider="tpattn.parallel.kv_heads",
                how="no all-reduce of the wk/wv gradients in the KV replica group",
                fix="all-reduce wk/wv gradients over each replica group",
                fidelity="mechanism",
                fidelity_note="issue 11: the reduction of MQA's key/value gradients, replicated "
                "over TP, left out the biases and was missing from the distributed optimizer; "
                "PR 12's log shows the K/V bias differing across TP ranks before the fix, equal "
                "after; the zoo drops the wk/wv gradient all-reduce of each replica group (no "
                "bias); the activation-gradient half is missing_input_grad_reduce"),
        BugMode("dropout_rng_desync",
                "torch's CPU generator drifts on tp_rank 0 alone (its data loader draws the "
                "workers' base seed): CPU residual-dropout masks differ across TP ranks",
                "bigscience-workshop/Megatron-DeepSpeed PR 276 (merged); "
                "NVIDIA/Megatron-LM PR 206 (not merged)", ("dropout > 0", "world_size >= 2"),
                Injection(rng="rank0_drift"),
                how="tp_rank 0 alone creates a DataLoader iterator, which draws its workers' "
                    "base_seed from the CPU default generator, before the residual dropout "
                    "draws its mask from that generator (dropout of CPU tensors; dropout of "
                    "CUDA tensors reads the CUDA generator, which this draw does not advance)",
                fix="give the loader its own generator (or re-sync the CPU and CUDA RNG "
                    "states across the TP group before the step)",
                fidelity="mechanism",
                fidelity_note="PR 276: the loader, built on tp_rank 0 only, drew the workers' "
                "base_seed from the CPU generator, so torch_rng_state differed across TP ranks, "
                "the data identical; the zoo drifts the same CPU generator with a real "
                "DataLoader iterator, and its CPU residual dropout reads it; on a GPU, dropout "
                "reads the CUDA generator: that drift desyncs only CPU draws (shuffles, "
                "CPU-side masks), and CUDA masks desync only when a CUDA random op runs on "
                "some TP ranks alone or the ranks seed CUDA differently"),
        BugMode("qk_norm_grad_not_reduced",
                "qk-norm weights replicated over TP without the all-reduce of their "
                "gradients: each rank steps on its own heads' part and the replicas drift",
                "NVIDIA-NeMo/RL issue 3716 (open)", ("qk_norm", "world_size >= 2"),
                Injection(qk_norm_grad="none"),
                how="no after-backward all-reduce of the q_norm/k_norm gradients over the TP "
                    "group: each rank's gradient sums only its local heads",
                fix="all-reduce the replicated q/k-norm gradients over TP after backward "
                    "(Megatron's finalize_model_grads)",
                fidelity="mechanism",
                fidelity_note="the issue: the split-API train step bypassed finalize_model_grads "
                "and its TP SUM for replicated params, so qk-layernorm replicas ([head_dim], "
                "local heads' partial grads) drift, no crash; the zoo skips that all-reduce "
                "in its train step (one block, plain SGD; not the SP layernorm half)"),
    ]



def _mesh_entries() -> list[BugMode]:
    """The bugs of a TP x DP mesh (``Config.data_parallel``; the engine's ``mesh_sync``):
    the logged loss and the gradient sync over the wrong group, and sequence parallelism's
    gather over the other mesh dimension."""
    return _loss_group_entries() + _grad_group_entries()


def _loss_group_entries() -> list[BugMode]:
    """The logged loss reduced over the wrong group of a TP x DP mesh."""
    dp = MESH_NEEDS[0]
    return [
        BugMode("loss_reduced_over_world",
                "TP x DP: the logged loss all-reduced over the world mesh, not the DP group",
                None, (dp,), Injection(loss_group="world"),
                how="the loss shares are summed over every rank of the mesh: each replica's "
                    "share counted once per TP rank (the ledger's loss all-reduce has group "
                    "world)",
                fix="all-reduce the loss metric over the DP submesh only",
                fidelity="no report",
                fidelity_note="no public report of an over-reported loss: pytorch/torchtitan "
                "PR 105 (FSDP + SP) moved the loss metric's all-reduce from the 2D world mesh "
                "to the DP submesh to fix a crash, and with its mean reduction the world "
                "group would have logged the right value; the TP-degree over-report exists "
                "only under this book's convention (each rank's loss is its share of the "
                "global mean, summed over DP)"),
        BugMode("loss_full_tensor_tp_only",
                "TP x DP: the logged loss is a Replicate DTensor on the TP mesh whose "
                "full_tensor() skips the DP reduction",
                "pytorch/torchtitan issue 3280; PR 3313 (root cause); PR 3204; fixed by PR 3159",
                (dp,), Injection(loss_group="tp"),
                how="_dist_reduce returns x.full_tensor() for a DTensor, dropping the caller's "
                    "mesh: a Replicate placement on the TP mesh reduces nothing, no DP "
                    "all-reduce (the ledger has no loss all-reduce)",
                fix="x.to_local(), then the all-reduce over the loss mesh (PR 3159)",
                fidelity="mechanism",
                fidelity_note="issue 3280 was reported for TP + CP: PR 3313 traced the "
                "under-reported loss to _dist_reduce's full_tensor() on a TP-only DTensor, "
                "which skips every mesh dimension outside the DTensor's; the DP case is PR "
                "3159's note ('under-reported by dp_shard x cp') and PR 3204's tests (a "
                "Replicate-on-TP loss over an orthogonal batch mesh); here the skipped "
                "dimension is DP of a TP x DP mesh, each replica logging its share"),
    ]


def _grad_group_entries() -> list[BugMode]:
    """The DP gradient sync and SP's gather over the wrong group of the mesh."""
    dp = MESH_NEEDS[0]
    return [
        BugMode("dp_grad_group_of_one",
                "TP x DP: the data-parallel gradient all-reduce runs over a group of one "
                "rank, a silent no-op",
                "ByteDance-Seed/VeOmni issue 1059; PR 1115; fixed by PR 1086", (dp,),
                Injection(dp_grad="self"),
                how="the DDP process group holds only this rank: each replica steps on its "
                    "own batch's share of the gradient and the replicas' weights drift apart "
                    "(the ledger's gradient all-reduce has group self)",
                fix="all-reduce the gradients over the whole data-parallel group",
                fidelity="mechanism",
                fidelity_note="there Ulysses SP shrank DDP's dp_group to one rank, so the "
                "gradient all-reduce was a no-op and each rank kept its sequence shard's "
                "gradient; here the missing dimension is DP of a TP x DP mesh"),
        BugMode("sp_gather_wrong_group",
                "TP x DP with sequence parallelism: the sequence all-gather (and its backward "
                "reduce-scatter) runs over the other mesh dimension's group",
                "NVIDIA/Megatron-LM issue 7452",
                ("sequence_parallel", dp, "data_parallel == world_size"),
                Injection(sp_group="dp"),
                how="the column-parallel input's SP all-gather and its backward "
                    "reduce-scatter run over the DP group (same size: the shapes are right, "
                    "another replica's tokens are mixed in); the output reduce-scatter stays "
                    "on the TP group (the ledger's SP gather has group dp)",
                fix="build linear_q/linear_kv with the module's tp_group",
                fidelity="mechanism",
                fidelity_note="finding 06 of the issue: CrossAttention builds linear_q and "
                "linear_kv without tp_group, so their SP all-gather runs over the global MPU "
                "TP group and mixes replicas (linear_proj keeps its group); here it is the "
                "self-attention block's Q/K/V input and the wrong group is DP's"),
    ]


def _loading_entries() -> list[BugMode]:
    """The bugs of loading a fused or grouped QKV checkpoint (around the block)."""
    return [
        BugMode("qkv_loaded_from_rank0",
                "every rank narrows rank 0's rows of a fused [Wq; Wk; Wv] checkpoint: "
                "the shapes are right, the numbers rank 0's",
                "vllm-project/vllm-gguf-plugin issue 103 (fixed by PR 106)",
                ("fused_qkv", "world_size >= 2"), Injection(shard="fused_rank0"),
                how="the loader reads tp_rank = kwargs.get('tp_rank', 0) and the caller never "
                    "passes it (block.fused_qkv.load_qkv_weight)",
                fix="take the rank from the process group (get_tensor_model_parallel_rank), "
                    "not from an optional keyword", fidelity="mechanism",
                fidelity_note="the plugin's load_qkv_weight and load_merged_column_weight read "
                "tp_rank from kwargs with default 0, which vLLM's weight_loader_v2 never passes, "
                "so every rank kept rank 0's shard (right shapes, wrong output at TP > 1; PR 106 "
                "asks the process group); the zoo's loader does that to the block's fused QKV, "
                "in training (no MLP, so no merged gate/up weight)"),
        BugMode("grouped_qkv_read_as_plain",
                "a QKV checkpoint fused per KV group read as plain [Q; K; V] on each rank: "
                "wrong once a rank holds two groups",
                "tenstorrent/tt-metal issue 6243 (closed)",
                ("fused_qkv", "kv_heads >= 2 * world_size"),
                Injection(shard="grouped_as_plain"),
                how="rank r narrows its rows [q_1; k_1; v_1; q_2; k_2; v_2] and reads the first "
                    "Hq/W*D as queries, the next Hkv/W*D as keys, the rest as values",
                fix="split the rank's rows per KV group ([q x g; k; v] each)",
                fidelity="mechanism",
                fidelity_note="nlp_create_qkv_heads split each device's fused QKV output "
                "assuming concat(q, k, v), but a device holding 2 of Falcon-40B's 8 groups had "
                "concat(q1, k1, v1, q2, k2, v2): bad PCC (fine at one group per device); the "
                "zoo reads the rank's weight rows that way (output column j is weight row j)"),
    ]


#: name -> BugMode, in listing order.
REGISTRY: dict[str, BugMode] = {m.name: m for m in _entries() + _mesh_entries() + _loading_entries()}


def register(mode: BugMode) -> None:
    """Add (or complete) a mode contributed by another module: its ``injection`` is the
    program ``tpattn.run`` and ``tpattn.observe`` run. Raises ``ValueError`` if the name is
    taken by a runnable mode of another provider, if ``mode.fidelity`` is not one of
    ``FIDELITIES``, or if it has a citation without a report's fidelity (or one without it).
    """
    if mode.fidelity not in FIDELITIES:
        raise ValueError(f"fidelity must be one of {', '.join(FIDELITIES)} "
                         f"(got {mode.fidelity!r})")
    if bool(mode.citation) != (mode.fidelity in ("mechanism", "consistent")):
        raise ValueError(f"citation must be given iff fidelity is 'mechanism' or 'consistent' "
                         f"(got fidelity={mode.fidelity!r}, citation={mode.citation!r})")
    old = REGISTRY.get(mode.name)
    if old is not None and old.provider != mode.provider and old.injection is not None:
        raise ValueError(f"mode {mode.name!r} is already registered by {old.provider}")
    REGISTRY[mode.name] = mode


def mode_names() -> tuple[str, ...]:
    """Every registered mode name (runnable or not), in listing order."""
    return tuple(REGISTRY)


def runnable_modes() -> tuple[str, ...]:
    """The modes with an injection that run on plain-TP shapes: those the hunts, the diagnosis's signatures and the zoo's tables run on the zoo's
    shapes. The modes with a ``LAYOUT_NEEDS`` need (sequence parallelism, replicated KV
    heads) are runnable and observable too (``list_modes``) but need their own ``Config``,
    so they are not in this tuple; nor are the modes of ``AROUND_THE_BLOCK``."""
    return tuple(n for n, m in REGISTRY.items()
                 if m.injection is not None and not set(m.needs) & set(LAYOUT_NEEDS)
                 and n not in AROUND_THE_BLOCK)


def reported_modes() -> tuple[str, ...]:
    """The registry's reproduced reported bugs: the entries whose ``fidelity`` is
    ``"mechanism"`` (the cited report's mechanism at its place). Any count of "reported
    bugs" counts these only."""
    return tuple(n for n, m in REGISTRY.items() if m.fidelity == "mechanism")


def list_modes() -> list[dict]:
    """``--list-modes``: every mode as ``BugMode.as_dict`` (name, description, citation,
    fidelity, fidelity_note, needs, provider, runnable, observable)."""
    return [m.as_dict() for m in REGISTRY.values()]


def get_mode(mode: str) -> BugMode:
    """The registry entry of ``mode``; ``ValueError`` naming the choices if there is none."""
    if mode not in REGISTRY:
        raise ValueError(f"mode must be one of {', '.join(REGISTRY)} (got {mode!r})")
    return REGISTRY[mode]


def modes_for(cfg: Config | None) -> tuple[str, ...]:
    """The modes of ``cfg``'s matrix: ``SP_MODES`` under ``sequence_parallel``; ``MODES`` plus
    ``missing_kv_grad_reduce`` where KV heads are replicated; else the seed's ``MODES``."""
    if cfg is not None and cfg.sequence_parallel:
        return SP_MODES
    if cfg is not None and kv_grad_bug_applies(cfg):
        return MODES + (MISSING_KV_GRAD_REDUCE,)
    return MODES


def check_mode(mode: str, cfg: Config | None = None) -> str:
    """Return ``mode`` if it is one of ``ALL_MODES`` (the seed's check's modes) and applies to
    ``cfg`` (``modes_for``), else raise ``ValueError`` naming the choices or the rule read
    from its injection (a ``norm_grad`` bug without ``cfg.sequence_parallel``, a ``kv_grad``
    bug without replicated KV heads, says so)."""
    entry = REGISTRY.get(mode) if isinstance(mode, str) and mode in ALL_MODES else None
    inj = entry.injection if entry is not None else None
    if inj is not None and inj.norm_grad != "sum" \
            and not (cfg is not None and cfg.sequence_parallel):
        raise ValueError(f"mode {mode} needs sequence_parallel=True (--sequence-parallel): "
                         f"only then is the norm weight's gradient a partial sum to all-reduce")
    if inj is not None and inj.kv_grad != "sum" and cfg is not None \
            and not kv_grad_bug_applies(cfg):
        raise ValueError(
            f"mode {mode} needs replicated KV heads: kv_heads < world_size "
            f"and kv_strategy='replicate_weights' (got kv_heads={cfg.kv_heads}, "
            f"world_size={cfg.world_size}, kv_strategy={cfg.kv_strategy!r})")
    valid = modes_for(cfg) if cfg is not None else ALL_MODES
    if mode not in valid:
        raise ValueError(f"mode must be one of {', '.join(valid)} (got {mode!r})")
    return mode


def check_needs(mode: str, cfg: Config) -> BugMode:
    """The entry of ``mode`` if this build can run it on ``cfg``, else ``ValueError`` naming
    the unmet need (setup needs such as ``bias`` are met by the mode itself). A mode
    whose injection is ``reduction_only`` (the seed's check's modes) is checked by
    ``check_mode``, which also says the rule of a layout need (``sequence_parallel=True``;
    ``kv_heads < world_size`` with ``kv_strategy="replicate_weights"``); any other mode of
    this block needs a plain-TP ``cfg`` (no ``sequence_parallel``, ``kv_heads >= world_size``)."""
    entry = get_mode(mode)
    if entry.injection is None:
        raise ValueError(f"mode {mode!r} has no injection of this block: {entry.provider} "
                         f"registered it without one (tpattn.bugs.zoo.register)")
    if mode in ALL_MODES:  # the original fixture's check's modes: its rules and layouts
        check_mode(mode, cfg)
    elif not set(entry.needs) & set(MESH_NEEDS):  # the zoo's other injections: plain TP
        if cfg.sequence_parallel:
            raise ValueError(f"mode {mode!r} is an injection of tpattn.bugs.zoo's block, which has "
                             f"no sequence parallelism: sequence_parallel must be False")
        if cfg.kv_heads < cfg.world_size:
            raise ValueError(f"mode {mode!r} is an injection of tpattn.bugs.zoo's block, which does "
                             f"not replicate KV heads: kv_heads must be >= world_size (got "
                             f"kv_heads={cfg.kv_heads}, world_size={cfg.world_size})")
    for need in entry.needs:
        if NEEDS.get(need, _met)(cfg):
            continue
        if need in MODEL_OPTION_NEEDS:
            raise ValueError(f"mode {mode!r} needs {need}: the model option its bug lives in "
                             f"(got dropout={cfg.dropout}, qk_norm={cfg.qk_norm}; "
                             f"--dropout P, --qk-norm)")
        mesh = (f", data_parallel={cfg.data_parallel}, sequence_parallel="
                f"{cfg.sequence_parallel}" if set(entry.needs) & set(MESH_NEEDS) else "")
        raise ValueError(f"mode {mode!r} needs {need} (got world_size={cfg.world_size}, "
                         f"query_heads={cfg.query_heads}, kv_heads={cfg.kv_heads}{mesh})")
    return entry


def forward_fixture(xs: list[torch.Tensor], p: dict[str, torch.Tensor], cfg: Config,
                    inj: Injection) -> torch.Tensor:
    """The ``"fixture"`` view: rank 0's output in one process, the ranks sharing ``p`` — the
    engine's block on ``one_graph.OneGraphRanks`` with the injection's cut (``shard``).

    xs: each rank's input ``[S, B, hidden]`` (the same tensor unless ``inputs="per_rank"``:
    then ranks >= 1's are constants); ``p``: dense parameters (the ranks' shards are views of
    them, so autograd's sum over the ranks' uses of ``n`` is f's all-reduce). Returns
    ``[S, B, hidden]``.
    """
    others = xs[1:] if inj.inputs == "per_rank" else None
    return one_graph_forward(xs[0], p, cfg, inj, lambda q, c: shard(q, c, inj), others)


def sides(mode: str, seed: int = 11, cfg: Config | None = None,
          simulate: str = "ranks") -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """The two sides ``run`` compares, as tensors: ``(dense, tp, params)`` — the dense step of
    the mode's setup and the sharded step with its injection (``check.one_step``'s dicts) and
    the starting parameters (with the bias, if the mode has one)."""
    cfg = Config() if cfg is None else cfg
    inj = check_needs(mode, cfg).injection
    if inj is None:
        raise ValueError(f"mode {mode!r} is not an injection of this block: it is run by "
                         f"{get_mode(mode).provider}")
    x0, target = make_inputs(cfg, check_seed(seed))
    base = make_params(cfg, seed, inj)
    return (dense_step(x0, target, base, cfg, inj, dropout_masks(cfg, seed)),
            tp_side(seed, cfg, inj, simulate), base)


def tp_side(seed: int, cfg: Config, inj: Injection, simulate: str = "fixture") -> dict:
    """``check.core.tp_step`` of the injection from seed ``seed``'s start (``make_params``,
    ``rank_batches``): the TP side ``run`` compares, in ``check.one_step``'s dict."""
    x0, target = make_inputs(cfg, seed)
    return tp_step(x0, target, make_params(cfg, seed, inj), cfg, inj, simulate,
                         batches=rank_batches(cfg, seed, inj), rng_seed=seed)
