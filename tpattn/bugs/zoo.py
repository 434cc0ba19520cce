"""The bug zoo: every mode ``tpattn.run`` accepts, as a ``BugMode`` of ``REGISTRY``: its
``Injection``, the public report, how faithfully it reproduces it and what it ``needs``."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tpattn.block.kv_layout import kv_grad_bug_applies
from tpattn.check.core import (ALL_MODES, EQUIVALENCE, MISSING_INPUT_GRAD_REDUCE,
                               MISSING_KV_GRAD_REDUCE, MISSING_NORM_GRAD_REDUCE,
                               MISSING_OUTPUT_REDUCE, MODES, NORM_GRAD_AVERAGED,
                               SP_MODES, block_inputs, check_seed,
                               clip_coef, dense_step, dropout_masks, load_rank_shard, make_inputs,
                               make_params, rank_batches, shard, tp_step, unshard)
from tpattn.config import Config
from tpattn.parallel.engine import MAX_GRAD_NORM
from tpattn.parallel.injection import Injection
from tpattn.parallel.one_graph import one_graph_forward

__all__ = ["Injection", "BugMode", "REGISTRY", "FIDELITIES", "register", "resolve",
           "mode_names", "list_modes", "runnable_modes", "reported_modes", "modes_for", "tp_side",
           "make_params", "shard", "unshard", "load_rank_shard", "sides", "forward_fixture",
           "block_inputs", "LAYOUT_NEEDS", "MESH_NEEDS", "Need", "MODEL_OPTION_NEEDS",
           "AROUND_THE_BLOCK", "MAX_GRAD_NORM", "rank_batches", "dense_step", "clip_coef"]

#: How faithfully an entry reproduces its report: ``"mechanism"`` (the report's mechanism at its
#: place), ``"consistent"`` (the simplest one consistent with a report without root cause),
#: ``"no report"`` (a plausible bug), ``"correct"`` (not a bug). Cited iff one of the first two.
FIDELITIES = ("mechanism", "consistent", "no report", "correct")


class Need(str):
    """A condition on the ``Config`` named by its text; ``need(cfg)`` tests it (no test: a setup
    the mode itself brings, such as ``bias``). Pickled as its text; the test is found by it."""

    tests: dict = {}

    def __new__(cls, text: str, test=None):
        if test is not None:
            cls.tests[text] = test
        return super().__new__(cls, text)

    def __call__(self, cfg: Config) -> bool:
        test = self.tests.get(self)
        return test is None or bool(test(cfg))


WORLD_2 = Need("world_size >= 2", lambda cfg: cfg.world_size >= 2)
SP = Need("sequence_parallel", lambda cfg: cfg.sequence_parallel)
KV_REPLICAS = Need("kv_heads < world_size", lambda cfg: cfg.kv_heads < cfg.world_size)
DROPOUT = Need("dropout > 0", lambda cfg: cfg.dropout > 0)
QK_NORM = Need("qk_norm", lambda cfg: cfg.qk_norm)
DP_2 = Need("data_parallel >= 2", lambda cfg: cfg.data_parallel >= 2)
DP_IS_TP = Need("data_parallel == world_size", lambda cfg: cfg.data_parallel == cfg.world_size)
TWO_KV_PER_RANK = Need("kv_heads >= 2 * world_size",
                       lambda cfg: cfg.kv_heads >= 2 * cfg.world_size)
GQA = Need("query_heads > kv_heads", lambda cfg: cfg.query_heads > cfg.kv_heads)
BIAS, GRAD_CLIP, FUSED_QKV = Need("bias"), Need("grad_clip"), Need("fused_qkv")

#: Needs that name a layout of the ``Config``: the mode's injection exists only there.
LAYOUT_NEEDS = (SP, KV_REPLICAS, DROPOUT, QK_NORM, DP_2, DP_IS_TP)
#: The needs of the TP x DP mesh's modes (any layout the engine's mesh runs).
MESH_NEEDS = (DP_2, DP_IS_TP)
#: The needs that are a model option (``--dropout P``, ``--qk-norm``).
MODEL_OPTION_NEEDS = (DROPOUT, QK_NORM)
#: Plain-TP loading modes that ``runnable_modes()`` leaves out (``evaluate.HELD_OUT`` hosts them).
AROUND_THE_BLOCK = ("qkv_loaded_from_rank0", "grouped_qkv_read_as_plain")


@dataclass(frozen=True)
class BugMode:
    """One entry of the registry: ``injection`` the sharded program (``None``: listed, not
    runnable), ``needs`` its ``Need``s, ``citation`` the public report(s), ``fidelity`` one of
    ``FIDELITIES`` and ``fidelity_note`` what the thread showed and where this differs."""

    name: str
    description: str
    citation: str | None
    needs: tuple[Need, ...] = ()
    injection: Injection | None = None
    provider: str = "tpattn.bugs.zoo"
    fidelity: str = "no report"
    fidelity_note: str = ""

    @property
    def is_correct(self) -> bool:
        """True when the entry's injection is its own bug-free twin (``equivalence``)."""
        return self.injection is not None and self.injection == self.injection.correct()

    def as_dict(self) -> dict:
        """What ``--list-modes`` prints for this mode."""
        return {"name": self.name, "description": self.description, "citation": self.citation,
                "fidelity": self.fidelity, "fidelity_note": self.fidelity_note,
                "needs": list(self.needs), "provider": self.provider,
                "runnable": self.injection is not None, "observable": self.injection is not None}


#: name -> BugMode, in listing order.
REGISTRY: dict[str, BugMode] = {m.name: m for m in [
        # correct TP and the bugs of f and g
        BugMode(EQUIVALENCE, "correct TP: g sums the output partials, f sums dn", None,
                injection=Injection(), fidelity="correct",
                fidelity_note="not a bug: the correct program every other mode is compared with"),
        BugMode(MISSING_OUTPUT_REDUCE, "g dropped: each rank's output is its own partial", None,
                (WORLD_2,), Injection(g=0),
                fidelity_note="the book's own bug (chapter 8); no public report is cited"),
        BugMode(MISSING_INPUT_GRAD_REDUCE, "f dropped: dn keeps one rank's contribution",
                "bigcode-project/Megatron-LM PR 36 (fixes issue 35); "
                "NVIDIA/Megatron-LM PR 6839 (open)",
                (WORLD_2,), Injection(f="none"), fidelity="mechanism",
                fidelity_note="bigcode PR 36: MQA's K/V projection, replicated over TP, lacked "
                "ColumnLinear's input-gradient all-reduce, so the loss exploded at TP 2 with the "
                "weights in sync (issue 35); Megatron-LM PR 6839: MLA's shared K-RoPE gradient "
                "summed over local heads only, fixed with copy_to_tensor_model_parallel_region; "
                "there one branch missed f, here all of dn (chapter 9)"),
        BugMode("input_grad_reduce_averaged",
                "f averages dn over the ranks instead of summing it", None,
                (WORLD_2,), Injection(f="mean"),
                fidelity_note="no public report of f averaging dn was found; EleutherAI/gpt-neox "
                "PR 1259 averaged the sequence-parallel LayerNorm weight-gradient hook (dX "
                "unaffected), which is norm_grad_averaged, not this"),
        BugMode("input_grad_reduced_twice",
                "dn all-reduced twice: replicated gradients come out W times too large",
                "modelscope/mcore-bridge PR 101; NVIDIA/Megatron-LM issue 1528 (open)",
                (WORLD_2,), Injection(f="twice"), fidelity="consistent",
                fidelity_note="mcore-bridge PR 101: OLMoE's q/k norms act on the gathered, "
                "TP-replicated tensor, so each rank already holds their full gradient, yet the "
                "name-matched qk-layernorm gradient all-reduce summed it again (x tp_size); issue "
                "1528 (open, no root cause) sees the LayerNorm weight gradient TP size times too "
                "large only with FP8 + TP + CP; the zoo sums dn twice, so the norm weight "
                "gradient is W times too large and dX is wrong too"),
        BugMode("output_reduced_twice",
                "g applied twice: the output is W times the sum of the partials", None,
                (WORLD_2,), Injection(g=2), fidelity_note="no public report found: the forward "
                "twin of input_grad_reduced_twice, a plausible bug"),
        # the step and loading: the norm, the bias, the fused checkpoint
        BugMode("grad_norm_counts_replicas",
                "replicated parameters counted W times in the global gradient norm "
                "(clipping wrong, every gradient right)",
                "NVIDIA-NeMo/RL PR 3788 (open); ROCm/TransformerEngine PR 715",
                (GRAD_CLIP, WORLD_2), Injection(norm="per_rank", clip=True), fidelity="mechanism",
                fidelity_note="RL PR 3788: get_grad_norm summed every parameter over the TP "
                "group, so TP-replicated q_norm/k_norm were counted tp_size times, the loss "
                "unchanged; TE PR 715: replicated weights marked tensor-parallel, counted tp_size "
                "times in Megatron's norm; the zoo counts the replicated norm weight per rank"),
        BugMode("row_bias_on_every_rank",
                "the row-parallel output bias is added on every rank before g: "
                "the output is off by (W-1)*b",
                "huggingface/text-generation-inference issue 1036; Wenyueh/MinivLLM issue 80",
                (BIAS, WORLD_2), Injection(bias="every_rank"), fidelity="mechanism",
                fidelity_note="both report the bias of a row-parallel linear added on every rank "
                "before the all-reduce (SUM), so the output holds tp_size biases (MinivLLM "
                "measured one extra bias at tp_size 2); the zoo adds it at that place"),
        BugMode("fused_qkv_naive_split",
                "a fused [Wq; Wk; Wv] weight cut into contiguous rank slices: "
                "rank 0 gets only query rows",
                "deepspeedai/DeepSpeed PR 3844",
                (FUSED_QKV, WORLD_2), Injection(shard="fused_naive"), fidelity="mechanism",
                fidelity_note="AutoTP cut fused QKV weights whose layout it did not know (GLM: "
                "all q heads, then all k, then all v) without regard to heads: incorrect "
                "inference results, no error; the PR splits each known layout by heads (the zoo's "
                "is that GLM layout, cut into contiguous slices, in training)"),
        # the KV layout, the inputs, sequence parallelism
        BugMode("repeat_kv_tiled",
                "repeat_kv tiles the KV heads instead of interleaving them: query heads "
                "read the wrong KV head",
                "onnx/onnx PR 7274 (open); ekzhang/jax-js PR 180",
                (TWO_KV_PER_RANK, GQA), Injection(kv="tile"), fidelity="mechanism",
                fidelity_note="a GQA layout bug independent of TP, reported on one device: ONNX's "
                "Attention op and jax-js tiled the KV heads ([h0, h1, h0, h1]) where torch "
                "repeat-interleaves; not a TP report: the zoo injects it on each rank's local KV "
                "heads, visible once a rank holds two"),
        BugMode("inputs_not_replicated",
                "each TP rank draws its own batch (the batches of a TP group differ)",
                "deepspeedai/DeepSpeed issue 7199", (WORLD_2,),
                Injection(inputs="per_rank"), fidelity="consistent",
                fidelity_note="DeepSpeed's AutoTP check stopped an HF Trainer run with 'Data "
                "inconsistency within the TP group'; the thread gives no root cause. Not "
                "bigscience-workshop/Megatron-DeepSpeed PR 276: there the data were identical and "
                "the CPU generator's state (torch_rng_state) desynced (the loader's seed consumed "
                "a draw on tp_rank 0 only), and nn.Dropout of CPU tensors with it: that one is "
                "dropout_rng_desync"),
        BugMode(MISSING_NORM_GRAD_REDUCE,
                "sequence parallelism without the all-reduce of the norm weight's gradient",
                "NVIDIA-NeMo/Speech PR 7184; hpcaitech/ColossalAI PR 4915",
                (SP,), Injection(norm_grad="none"), provider="tpattn.parallel.sequence_parallel",
                fidelity="mechanism",
                fidelity_note="NeMo PR 7184: the all-reduce of sequence-parallel LayerNorm "
                "gradients looked for a 'sequence_parallel' attribute that apex's LayerNorm names "
                "'sequence_parallel_enabled', so it was skipped; ColossalAI PR 4915 adds the "
                "missing all-reduce; tpattn.parallel.sequence_parallel drops it at that place"),
        BugMode(NORM_GRAD_AVERAGED,
                "sequence parallelism: the norm weight's gradient averaged instead of summed",
                "EleutherAI/gpt-neox PR 1259", (SP,),
                Injection(norm_grad="mean"), provider="tpattn.parallel.sequence_parallel",
                fidelity="mechanism",
                fidelity_note="the SP LayerNorm gradient hook averaged over the sequence shards "
                "instead of summing (and was registered before deepspeed.initialize); the PR "
                "sums, and says it does not fix the run's convergence issue, whose slowly "
                "changing LayerNorm weights it reports as still open"),
        # the KV replicas and the model options
        BugMode(MISSING_KV_GRAD_REDUCE,
                "replicated KV heads without the all-reduce of their gradients",
                "bigcode-project/Megatron-LM issue 11; fixed by PR 12",
                (KV_REPLICAS,), Injection(kv_grad="none"), provider="tpattn.parallel.kv_heads",
                fidelity="mechanism",
                fidelity_note="issue 11: the reduction of MQA's key/value gradients, replicated "
                "over TP, left out the biases and was missing from the distributed optimizer; PR "
                "12's log shows the K/V bias differing across TP ranks before the fix, equal "
                "after; the zoo drops the wk/wv gradient all-reduce of each replica group (no "
                "bias); the activation-gradient half is missing_input_grad_reduce"),
        BugMode("dropout_rng_desync",
                "torch's CPU generator drifts on tp_rank 0 alone (its data loader draws the "
                "workers' base seed): CPU residual-dropout masks differ across TP ranks",
                "bigscience-workshop/Megatron-DeepSpeed PR 276 (merged); "
                "NVIDIA/Megatron-LM PR 206 (not merged)", (DROPOUT, WORLD_2),
                Injection(rng="rank0_drift"), fidelity="mechanism",
                fidelity_note="PR 276: the loader, built on tp_rank 0 only, drew the workers' "
                "base_seed from the CPU generator, so torch_rng_state differed across TP ranks, "
                "the data identical; the zoo drifts it with a real DataLoader iterator and its "
                "CPU residual dropout reads it; on a GPU dropout reads the CUDA generator: that "
                "drift desyncs only CPU draws (shuffles, CPU-side masks); CUDA masks desync only "
                "if a CUDA random op runs on some TP ranks alone or their CUDA seeds differ"),
        BugMode("qk_norm_grad_not_reduced",
                "qk-norm weights replicated over TP without the all-reduce of their "
                "gradients: each rank steps on its own heads' part and the replicas drift",
                "NVIDIA-NeMo/RL issue 3716 (open)", (QK_NORM, WORLD_2),
                Injection(qk_norm_grad="none"), fidelity="mechanism",
                fidelity_note="the issue: the split-API train step bypassed finalize_model_grads "
                "and its TP SUM for replicated params, so qk-layernorm replicas ([head_dim], "
                "local heads' partial grads) drift, no crash; the zoo skips that all-reduce in "
                "its train step (one block, plain SGD; not the SP layernorm half)"),
        # a TP x DP mesh: the logged loss over the wrong group
        BugMode("loss_reduced_over_world",
                "TP x DP: the logged loss all-reduced over the world mesh, not the DP group",
                None, (DP_2,), Injection(loss_group="world"), fidelity="no report",
                fidelity_note="no public report of an over-reported loss: pytorch/torchtitan PR "
                "105 (FSDP + SP) moved the loss metric's all-reduce from the 2D world mesh to the "
                "DP submesh to fix a crash; with its mean reduction the world group would have "
                "logged the right value; the TP-degree over-report needs this book's convention "
                "(each rank's loss is its share of the global mean, summed over DP)"),
        BugMode("loss_full_tensor_tp_only",
                "TP x DP: the logged loss is a Replicate DTensor on the TP mesh whose "
                "full_tensor() skips the DP reduction",
                "pytorch/torchtitan issue 3280; PR 3313 (root cause); PR 3204; fixed by PR 3159",
                (DP_2,), Injection(loss_group="tp"), fidelity="mechanism",
                fidelity_note="issue 3280 was on TP + CP: PR 3313 traced the under-reported loss "
                "to _dist_reduce's full_tensor() on a TP-only DTensor, skipping every mesh "
                "dimension outside its own; the DP case is PR 3159's note ('under-reported by "
                "dp_shard x cp') and PR 3204's tests (a Replicate-on-TP loss over an orthogonal "
                "batch mesh); here it skips DP of a TP x DP mesh, each replica logging its share"),
        # the DP gradient sync and the SP gather over the wrong group
        BugMode("dp_grad_group_of_one",
                "TP x DP: the data-parallel gradient all-reduce runs over a group of one "
                "rank, a silent no-op",
                "ByteDance-Seed/VeOmni issue 1059; PR 1115; fixed by PR 1086", (DP_2,),
                Injection(dp_grad="self"), fidelity="mechanism",
                fidelity_note="there Ulysses SP shrank DDP's dp_group to one rank, so the "
                "gradient all-reduce was a no-op and each rank kept its sequence shard's "
                "gradient; here the missing dimension is DP of a TP x DP mesh"),
        BugMode("sp_gather_wrong_group",
                "TP x DP with sequence parallelism: the sequence all-gather (and its backward "
                "reduce-scatter) runs over the other mesh dimension's group",
                "NVIDIA/Megatron-LM issue 7452", (SP, DP_2, DP_IS_TP),
                Injection(sp_group="dp"), fidelity="mechanism",
                fidelity_note="finding 06 of the issue: CrossAttention builds linear_q and "
                "linear_kv without tp_group, so their SP all-gather runs over the global MPU TP "
                "group and mixes replicas (linear_proj keeps its group); here it is the "
                "self-attention block's Q/K/V input and the wrong group is DP's"),
        # loading a fused or grouped QKV checkpoint
        BugMode("qkv_loaded_from_rank0",
                "every rank narrows rank 0's rows of a fused [Wq; Wk; Wv] checkpoint: "
                "the shapes are right, the numbers rank 0's",
                "vllm-project/vllm-gguf-plugin issue 103 (fixed by PR 106)",
                (FUSED_QKV, WORLD_2), Injection(shard="fused_rank0"), fidelity="mechanism",
                fidelity_note="the plugin's load_qkv_weight and load_merged_column_weight read "
                "tp_rank from kwargs with default 0, which vLLM's weight_loader_v2 never passes, "
                "so every rank kept rank 0's shard (right shapes, wrong output at TP > 1; PR 106 "
                "asks the process group); the zoo's loader does that to the block's fused QKV, in "
                "training (no MLP, so no merged gate/up weight)"),
        BugMode("grouped_qkv_read_as_plain",
                "a QKV checkpoint fused per KV group read as plain [Q; K; V] on each rank: "
                "wrong once a rank holds two groups",
                "tenstorrent/tt-metal issue 6243 (closed)", (FUSED_QKV, TWO_KV_PER_RANK),
                Injection(shard="grouped_as_plain"), fidelity="mechanism",
                fidelity_note="nlp_create_qkv_heads split each device's fused QKV output assuming "
                "concat(q, k, v), but a device holding 2 of Falcon-40B's 8 groups had concat(q1, "
                "k1, v1, q2, k2, v2): bad PCC (fine at one group per device); the zoo reads the "
                "rank's weight rows that way (output column j is weight row j)"),
]}


def register(mode: BugMode) -> None:
    """Add (or complete) a mode of another module; ``ValueError`` for a fidelity not in
    ``FIDELITIES``, a citation iff not a report's fidelity, or another provider's name."""
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
    """The modes with an injection on plain-TP shapes: no ``LAYOUT_NEEDS``, not around the block."""
    return tuple(n for n, m in REGISTRY.items()
                 if m.injection is not None and not set(m.needs) & set(LAYOUT_NEEDS)
                 and n not in AROUND_THE_BLOCK)


def reported_modes() -> tuple[str, ...]:
    """The reproduced reported bugs: the entries of ``fidelity`` ``"mechanism"``."""
    return tuple(n for n, m in REGISTRY.items() if m.fidelity == "mechanism")


def list_modes() -> list[dict]:
    """``--list-modes``: every mode as ``BugMode.as_dict``."""
    return [m.as_dict() for m in REGISTRY.values()]


def modes_for(cfg: Config | None) -> tuple[str, ...]:
    """The modes of ``cfg``'s matrix: ``SP_MODES``, or ``MODES`` (KV replicas: and their bug)."""
    if cfg is not None and cfg.sequence_parallel:
        return SP_MODES
    if cfg is not None and kv_grad_bug_applies(cfg):
        return MODES + (MISSING_KV_GRAD_REDUCE,)
    return MODES


def resolve(mode: str, cfg: Config | None = None, strict: bool = False) -> BugMode:
    """The registry entry of ``mode`` if it can run on ``cfg`` (no ``cfg``: the name only),
    else ``ValueError`` naming the rule it breaks. ``ALL_MODES`` meet the original fixture's
    rules, and their ``Need``s only when ``strict`` (``run`` lets them run at world size 1);
    the others need an injection (when ``strict``), plain TP off the mesh and every ``Need``."""
    entry = REGISTRY.get(mode) if isinstance(mode, str) else None
    if entry is None:
        raise ValueError(f"mode must be one of {', '.join(modes_for(cfg))} or a registry mode "
                         f"(python -m tpattn --list-modes) (got {mode!r})")
    if cfg is None:
        return entry
    if mode in ALL_MODES:
        _check_fixture_mode(mode, entry.injection, cfg)
    if not strict and (mode in ALL_MODES or entry.injection is None):
        return entry
    if entry.injection is None:
        raise ValueError(f"mode {mode!r} has no injection of this block: {entry.provider} "
                         f"registered it without one (tpattn.bugs.zoo.register)")
    if mode not in ALL_MODES and not set(entry.needs) & set(MESH_NEEDS):
        _check_plain_tp(mode, cfg)
    for need in entry.needs:
        if not need(cfg):
            _raise_unmet(entry, need, cfg)
    return entry


def _check_fixture_mode(mode: str, inj: Injection, cfg: Config) -> None:
    """The original fixture's rules for one of ``ALL_MODES``: its layout, then ``modes_for``."""
    if inj.norm_grad != "sum" and not cfg.sequence_parallel:
        raise ValueError(f"mode {mode} needs sequence_parallel=True (--sequence-parallel): "
                         f"only then is the norm weight's gradient a partial sum to all-reduce")
    if inj.kv_grad != "sum" and not kv_grad_bug_applies(cfg):
        raise ValueError(f"mode {mode} needs replicated KV heads: kv_heads < world_size and "
                         f"kv_strategy='replicate_weights' (got kv_heads={cfg.kv_heads}, "
                         f"world_size={cfg.world_size}, kv_strategy={cfg.kv_strategy!r})")
    if mode not in modes_for(cfg):
        raise ValueError(f"mode must be one of {', '.join(modes_for(cfg))} (got {mode!r})")


def _check_plain_tp(mode: str, cfg: Config) -> None:
    """The zoo's block off the mesh has neither sequence parallelism nor KV replicas."""
    block = f"mode {mode!r} is an injection of tpattn.bugs.zoo's block, which "
    if cfg.sequence_parallel:
        raise ValueError(block + "has no sequence parallelism: sequence_parallel must be False")
    if cfg.kv_heads < cfg.world_size:
        raise ValueError(block + f"does not replicate KV heads: kv_heads must be >= world_size "
                         f"(got kv_heads={cfg.kv_heads}, world_size={cfg.world_size})")


def _raise_unmet(entry: BugMode, need: Need, cfg: Config) -> None:
    """``ValueError`` naming ``need``, which ``cfg`` does not meet, and ``cfg``'s sizes."""
    if need in MODEL_OPTION_NEEDS:
        raise ValueError(f"mode {entry.name!r} needs {need}: the model option its bug lives in "
                         f"(got dropout={cfg.dropout}, qk_norm={cfg.qk_norm}; "
                         f"--dropout P, --qk-norm)")
    mesh = (f", data_parallel={cfg.data_parallel}, sequence_parallel="
            f"{cfg.sequence_parallel}" if set(entry.needs) & set(MESH_NEEDS) else "")
    raise ValueError(f"mode {entry.name!r} needs {need} (got world_size={cfg.world_size}, "
                     f"query_heads={cfg.query_heads}, kv_heads={cfg.kv_heads}{mesh})")


def forward_fixture(xs: list[torch.Tensor], p: dict[str, torch.Tensor], cfg: Config,
                    inj: Injection) -> torch.Tensor:
    """Rank 0's output ``[S, B, hidden]`` in one graph from each rank's input ``xs``."""
    others = xs[1:] if inj.inputs == "per_rank" else None
    return one_graph_forward(xs[0], p, cfg, inj, lambda q, c: shard(q, c, inj), others)


def sides(mode: str, seed: int = 11, cfg: Config | None = None,
          simulate: str = "ranks") -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """``(dense, tp, params)``: the two ``one_step`` dicts ``run`` compares, and the start."""
    cfg = Config() if cfg is None else cfg
    inj = resolve(mode, cfg, strict=True).injection
    x0, target = make_inputs(cfg, check_seed(seed))
    base = make_params(cfg, seed, inj)
    return (dense_step(x0, target, base, cfg, inj, dropout_masks(cfg, seed)),
            tp_side(seed, cfg, inj, simulate), base)


def tp_side(seed: int, cfg: Config, inj: Injection, simulate: str = "fixture") -> dict:
    """``tp_step`` of the injection from seed ``seed``'s start: the TP side ``run`` compares."""
    x0, target = make_inputs(cfg, seed)
    return tp_step(x0, target, make_params(cfg, seed, inj), cfg, inj, simulate,
                   batches=rank_batches(cfg, seed, inj), rng_seed=seed)
