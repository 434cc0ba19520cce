"""The bug zoo: a registry of tensor-parallel bugs, each one injectable, and how faithfully
each reproduces a public report.

Every entry of ``REGISTRY`` is a ``BugMode``: a name (a valid ``--mode``), a one-line
description, how it is injected (an ``Injection``: which knob of the sharded block it turns),
the public report it is compared with (repository + issue/PR number), its ``fidelity`` to that
report (one of ``FIDELITIES``, with a one-line ``fidelity_note``) and what the setup ``needs``
(``bias``, ``world_size >= 2``, ...). ``run(seed, mode, cfg, simulate)`` runs one of them in
``tpattn.run``'s dict; ``tpattn.run`` hands every registry mode it does not know to here.
Only ``"mechanism"`` entries (``reported_modes()``) count as reproduced reported bugs.

Each mode's ``Injection`` (``tpattn.parallel.injection``, whose docstring lists the knobs:
f, g, bias, shard, kv, inputs, norm, clip, kv_grad, norm_grad) says how the sharded block is
wired; ``tpattn.parallel.engine.rank_block`` is that block.

Both ``simulate`` semantics of ``tpattn.run`` are supported: ``"fixture"`` (one process, dense
tensors shared by the ranks, rank 0's output and loss) and ``"ranks"`` (every simulated rank its
own leaf tensors, output, loss and backward, as real ranks run: the engine on
``tpattn.parallel.simulated``; ``tpattn.real.ranks`` runs the same injections on real
processes). The ``"fixture"`` view is ``forward_fixture``, one graph in rank 0's view (the
engine on ``tpattn.parallel.one_graph.OneGraphRanks``).

Other modules contribute modes with ``register``. Three entries are injections that need a
layout of the ``Config`` (``LAYOUT_NEEDS``): ``missing_norm_grad_reduce`` and
``norm_grad_averaged`` (``norm_grad``) need ``sequence_parallel=True``,
``missing_kv_grad_reduce`` (``kv_grad``) needs replicated KV heads (``kv_heads < world_size``,
``kv_strategy="replicate_weights"``). ``run`` runs them in both simulations (``tpattn.observe``
watches them on the simulated ranks); ``runnable_modes()`` leaves them out: the hunts and
tables run on plain-TP shapes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from tpattn.check.core import (EQUIVALENCE, LR, MISSING_INPUT_GRAD_REDUCE, MISSING_KV_GRAD_REDUCE,
                    MISSING_NORM_GRAD_REDUCE, MISSING_OUTPUT_REDUCE, NATIVE_INJECTIONS,
                    NATIVE_MODES, NORM_GRAD_AVERAGED, PARAM_SEED_OFFSET, check_mode, check_seed,
                    check_simulate, dense_reference, five_measures, make_inputs)
from tpattn.config import Config
from tpattn.block.sgd import sgd_step
from tpattn.block.dense import dense_forward
from tpattn.block.params import INIT_STD, PARAM_NAMES, clone_trainable, init_params, rank_head_slices, \
    shard_params, unshard_params
from tpattn.parallel.engine import MAX_GRAD_NORM, REPLICATED
from tpattn.parallel.engine import ScaleGrad as GradScale
from tpattn.parallel.one_graph import one_graph_forward
from tpattn.parallel.injection import Injection
from tpattn.parallel.sequence_parallel import rank_tokens
from tpattn.parallel.simulated import rank0_view, simulated_step

__all__ = ["Injection", "BugMode", "REGISTRY", "FIDELITIES", "register", "get_mode",
           "mode_names", "grad_norm", "list_modes", "runnable_modes", "reported_modes",
           "check_needs", "run",
           "make_params", "shard", "unshard", "sides", "forward_fixture", "block_inputs",
           "LAYOUT_NEEDS",
           "GradScale", "MAX_GRAD_NORM", "BIAS_SEED_OFFSET", "OTHER_BATCH_SEED_OFFSET"]

#: The optional output-projection bias is drawn from its own generator, ``seed + this``, so the
#: seed's parameters and their init order never change.
BIAS_SEED_OFFSET = 200
#: Under ``inputs="per_rank"`` rank ``r >= 1`` draws its batch from ``seed + this * r``.
OTHER_BATCH_SEED_OFFSET = 7919
#: How faithfully an entry reproduces its public report. ``"mechanism"``: the report's
#: mechanism, at its place; ``"consistent"``: the simplest mechanism consistent with a report
#: whose thread establishes no root cause; ``"no report"``: no public report found (a plausible
#: bug); ``"correct"``: not a bug (``equivalence``). An entry has a citation iff its fidelity is
#: ``"mechanism"`` or ``"consistent"``.
FIDELITIES = ("mechanism", "consistent", "no report", "correct")
#: The ``needs`` that name a layout of the ``Config`` rather than a setup: the mode's injection
#: exists only there (``check.core.check_mode`` states the rule) and runs on the engine's
#: ranks and in the fixture's one-graph view alike.
LAYOUT_NEEDS = ("sequence_parallel", "kv_heads < world_size")


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
    return [
        BugMode(EQUIVALENCE, "correct TP: g sums the output partials, f sums dn", None,
                injection=NATIVE_INJECTIONS[EQUIVALENCE], how="both reductions", fix="-",
                fidelity="correct",
                fidelity_note="not a bug: the correct program every other mode is compared with"),
        BugMode(MISSING_OUTPUT_REDUCE, "g dropped: each rank's output is its own partial", None,
                ("world_size >= 2",), NATIVE_INJECTIONS[MISSING_OUTPUT_REDUCE],
                how="no forward all-reduce of partials",
                fix="all-reduce the row-parallel output (g) before the residual",
                fidelity_note="the book's own bug (chapter 8); no public report is cited"),
        BugMode(MISSING_INPUT_GRAD_REDUCE, "f dropped: dn keeps one rank's contribution", None,
                ("world_size >= 2",), NATIVE_INJECTIONS[MISSING_INPUT_GRAD_REDUCE],
                how="no backward all-reduce of dn",
                fix="all-reduce dn in backward (f, copy_to_tensor_model_parallel_region)",
                fidelity_note="the book's own bug (chapter 9); no public report is cited"),
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
                "NVIDIA/Megatron-LM issue 1528 (open)", ("world_size >= 2",),
                Injection(f="twice"),
                how="two backward all-reduces of dn (f and an extra dgrad all-reduce)",
                fix="reduce dn once: drop the second all-reduce", fidelity="consistent",
                fidelity_note="the issue (open, no root cause found) sees the LayerNorm weight "
                "gradient TP size times too large only with FP8 + TP + CP (TP alone or CP alone "
                "match one device) and reports no other tensor; the zoo's second all-reduce of "
                "dn gives that factor with TP alone, and dX is wrong too"),
        BugMode("output_reduced_twice",
                "g applied twice: the output is W times the sum of the partials", None,
                ("world_size >= 2",), Injection(g=2),
                how="two forward all-reduces of the output partials",
                fix="all-reduce the partials once",
                fidelity_note="no public report found: the forward twin of "
                "input_grad_reduced_twice, a plausible bug"),
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
        BugMode("repeat_kv_tiled",
                "repeat_kv tiles the KV heads instead of interleaving them: query heads "
                "read the wrong KV head",
                "onnx/onnx PR 7274 (open); ekzhang/jax-js PR 180",
                ("kv_heads >= 2 * world_size", "query_heads > kv_heads"), Injection(kv="tile"),
                how="k.repeat(1, 1, groups, 1) on each rank instead of repeat_interleave",
                fix="repeat_interleave: query head h reads KV head h // groups",
                fidelity="mechanism",
                fidelity_note="a GQA layout bug independent of TP: ONNX's Attention op and "
                "jax-js tiled the KV heads ([h0, h1, h0, h1]) where torch repeat-interleaves; "
                "the zoo injects it on each rank's local KV heads, visible once a rank holds two"),
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
                "and the torch RNG state desynced (the loader's seed consumed RNG on tp_rank 0 "
                "only), so nn.Dropout masks differed across TP ranks (not reproduced: no "
                "dropout here)"),
        BugMode("missing_norm_grad_reduce",
                "sequence parallelism without the all-reduce of the norm weight's gradient",
                "NVIDIA-NeMo/Speech PR 7184; hpcaitech/ColossalAI PR 4915",
                ("sequence_parallel",), NATIVE_INJECTIONS[MISSING_NORM_GRAD_REDUCE],
                provider="tpattn.parallel.sequence_parallel",
                how="no all-reduce of the norm weight's gradient after backward",
                fix="all-reduce the norm weight's gradient over the TP group",
                fidelity="mechanism",
                fidelity_note="NeMo PR 7184: the all-reduce of sequence-parallel LayerNorm "
                "gradients looked for a 'sequence_parallel' attribute that apex's LayerNorm "
                "names 'sequence_parallel_enabled', so it was skipped; ColossalAI PR 4915 adds "
                "the missing all-reduce; tpattn.parallel.sequence_parallel drops it at that place"),
        BugMode("norm_grad_averaged",
                "sequence parallelism: the norm weight's gradient averaged instead of summed",
                "EleutherAI/gpt-neox PR 1259", ("sequence_parallel",),
                NATIVE_INJECTIONS[NORM_GRAD_AVERAGED],
                provider="tpattn.parallel.sequence_parallel",
                how="the norm weight's gradient all-reduced with op AVG (sum / W): the ledger "
                    "shows op avg where the plan has sum",
                fix="reduce with SUM: each rank's gradient covers different tokens",
                fidelity="mechanism",
                fidelity_note="the SP LayerNorm gradient hook averaged over the sequence "
                "shards instead of summing (and was registered before deepspeed.initialize); "
                "the PR sums, and says it does not fix the run's convergence issue, whose "
                "slowly changing LayerNorm weights it reports as still open"),
        BugMode("missing_kv_grad_reduce",
                "replicated KV heads without the all-reduce of their gradients", None,
                ("kv_heads < world_size",), NATIVE_INJECTIONS[MISSING_KV_GRAD_REDUCE],
                provider="tpattn.parallel.kv_heads",
                how="no all-reduce of the wk/wv gradients in the KV replica group",
                fix="all-reduce wk/wv gradients over each replica group",
                fidelity_note="no public report of this bug was found; the related "
                "bigcode-project/Megatron-LM issue 35 (MQA + TP > 1: loss explodes, weights in "
                "sync) is the other half, the shared K/V's activation gradients (chapter 13)"),
    ]


#: name -> BugMode, in listing order.
REGISTRY: dict[str, BugMode] = {m.name: m for m in _entries()}


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
    so they are not in this tuple."""
    return tuple(n for n, m in REGISTRY.items()
                 if m.injection is not None and not set(m.needs) & set(LAYOUT_NEEDS))


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


def check_needs(mode: str, cfg: Config) -> BugMode:
    """The entry of ``mode`` if this build can run it on ``cfg``, else ``ValueError`` naming
    the unmet need (setup needs such as ``bias`` are met by the mode itself). A mode
    ``tpattn.run`` computes itself (``check.NATIVE_MODES``) is checked by
    ``check.check_mode``, which also says the rule of a layout need (``sequence_parallel=True``;
    ``kv_heads < world_size`` with ``kv_strategy="replicate_weights"``); any other mode of
    this block needs a plain-TP ``cfg`` (no ``sequence_parallel``, ``kv_heads >= world_size``)."""
    entry = get_mode(mode)
    if entry.injection is None:
        raise ValueError(f"mode {mode!r} has no injection of this block: {entry.provider} "
                         f"registered it without one (tpattn.bugs.zoo.register)")
    if mode in NATIVE_MODES:  # tpattn.run's own modes: its rules on cfg and its layouts
        check_mode(mode, cfg)
    elif entry.injection is not None:  # this block: plain TP, every rank its own KV heads
        if cfg.sequence_parallel:
            raise ValueError(f"mode {mode!r} is an injection of tpattn.bugs.zoo's block, which has "
                             f"no sequence parallelism: sequence_parallel must be False")
        if cfg.kv_heads < cfg.world_size:
            raise ValueError(f"mode {mode!r} is an injection of tpattn.bugs.zoo's block, which does "
                             f"not replicate KV heads: kv_heads must be >= world_size (got "
                             f"kv_heads={cfg.kv_heads}, world_size={cfg.world_size})")
    rules = {"world_size >= 2": cfg.world_size >= 2, "sequence_parallel": cfg.sequence_parallel,
             "kv_heads >= 2 * world_size": cfg.kv_heads >= 2 * cfg.world_size,
             "query_heads > kv_heads": cfg.query_heads > cfg.kv_heads,
             "kv_heads < world_size": cfg.kv_heads < cfg.world_size}
    for need in entry.needs:
        if not rules.get(need, True):
            raise ValueError(f"mode {mode!r} needs {need} (got world_size={cfg.world_size}, "
                             f"query_heads={cfg.query_heads}, kv_heads={cfg.kv_heads})")
    return entry


# --- parameters and their layout -----------------------------------------------------------

def make_params(cfg: Config, seed: int, inj: Injection) -> dict[str, torch.Tensor]:
    """``init_params(cfg, seed + PARAM_SEED_OFFSET)`` plus, when the setup has one, the output
    bias ``[hidden]`` from its own generator (``seed + BIAS_SEED_OFFSET``): the seed's
    parameters are the same numbers with or without it."""
    base = init_params(cfg, seed + PARAM_SEED_OFFSET)
    if inj.bias is not None:
        g = torch.Generator().manual_seed(seed + BIAS_SEED_OFFSET)
        base["bias"] = (torch.randn(cfg.hidden, generator=g) * INIT_STD).to(cfg.torch_dtype)
    return base


def _fused_rows(cfg: Config, rank: int) -> slice:
    rows = (cfg.query_heads + 2 * cfg.kv_heads) * cfg.head_dim // cfg.world_size
    return slice(rank * rows, (rank + 1) * rows)


def shard(p: dict[str, torch.Tensor], cfg: Config, inj: Injection) -> list[dict[str, torch.Tensor]]:
    """Every rank's parameters, as the injection's loader cuts them (differentiable views or
    slices of ``p``, so gradients flow back to ``p``).

    ``"heads"``/``"fused"``: ``shard_params`` (a fused checkpoint split by heads is the same
    numbers). ``"fused_naive"``: rank r takes contiguous rows of ``[Wq; Wk; Wv]`` and reads the
    first ``Hq/W * D`` as its query rows, the next ``Hkv/W * D`` as keys, the rest as values.
    Replicated tensors (``norm``, ``bias``) are shared. ``shard_offset`` k: rank r gets
    rank ``(r + k) mod W``'s shards.
    """
    if inj.shard != "fused_naive":
        shards = shard_params({k: p[k] for k in PARAM_NAMES}, cfg)
    else:
        fused = torch.cat([p["wq"], p["wk"], p["wv"]])
        q, kv = cfg.local_query_heads * cfg.head_dim, cfg.local_kv_heads * cfg.head_dim
        shards = []
        for rank in range(cfg.world_size):
            rows = fused[_fused_rows(cfg, rank)]
            q_cols, _ = rank_head_slices(cfg, rank)
            shards.append({"norm": p["norm"], "wq": rows[:q], "wk": rows[q:q + kv],
                           "wv": rows[q + kv:], "wo": p["wo"][:, q_cols]})
    if inj.shard_offset:  # rank r loads rank (r + k) mod W's shards
        k = inj.shard_offset % cfg.world_size
        shards = shards[k:] + shards[:k]
    if "bias" in p:
        for s in shards:
            s["bias"] = p["bias"]
    return shards


def unshard(shards: list[dict[str, torch.Tensor]], cfg: Config, inj: Injection) -> dict[str, torch.Tensor]:
    """The inverse of ``shard``: full-size tensors from every rank's own tensors (replicated
    ones from rank 0)."""
    if inj.shard_offset:
        k = inj.shard_offset % cfg.world_size
        shards = shards[len(shards) - k:] + shards[:len(shards) - k]
    if inj.shard != "fused_naive":
        full = unshard_params([{k: s[k] for k in PARAM_NAMES} for s in shards], cfg)
    else:
        fused = torch.cat([torch.cat([s["wq"], s["wk"], s["wv"]]) for s in shards]).detach()
        q, kv = cfg.query_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        full = {"norm": shards[0]["norm"].detach().clone(), "wq": fused[:q].clone(),
                "wk": fused[q:q + kv].clone(), "wv": fused[q + kv:].clone(),
                "wo": torch.cat([s["wo"] for s in shards], dim=1).detach().clone()}
        full = {k: full[k] for k in PARAM_NAMES}
    if "bias" in shards[0]:
        full["bias"] = shards[0]["bias"].detach().clone()
    return full


# --- the per-rank block ---------------------------------------------------------------------

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


# --- one training step ------------------------------------------------------------------

def rank_batches(cfg: Config, seed: int, inj: Injection) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's ``(x, target)`` as it loads them, ``[S, B, hidden]`` each: the seed's
    batch on every rank, or under ``inputs="per_rank"`` rank ``r >= 1``'s own from
    ``seed + OTHER_BATCH_SEED_OFFSET * r`` (``block_inputs``: the part the block takes)."""
    first = make_inputs(cfg, seed)
    if inj.inputs != "per_rank":
        return [first] * cfg.world_size
    return [first] + [make_inputs(cfg, seed + OTHER_BATCH_SEED_OFFSET * r)
                      for r in range(1, cfg.world_size)]


def block_inputs(batches: list[tuple[torch.Tensor, torch.Tensor]],
                 cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The part of every rank's loaded ``(x, target)`` ``[S, B, hidden]`` that enters its
    block: under ``cfg.sequence_parallel`` rank r's own tokens ``[S/W, B, hidden]``
    (``sequence_parallel.rank_tokens``: the scatter along the sequence), else the batch."""
    if not cfg.sequence_parallel:
        return list(batches)
    return [(x[rank_tokens(cfg, r)], t[rank_tokens(cfg, r)])
            for r, (x, t) in enumerate(batches)]


def grad_norm(grads: list[dict[str, torch.Tensor]], inj: Injection) -> torch.Tensor:
    """The global gradient norm as the TP code computes it: each rank sums the squares of its
    own gradients (replicated ones on rank 0 only, or on every rank under ``norm="per_rank"``),
    then one all-reduce (sum) over the ranks."""
    total = 0.0
    for rank, g in enumerate(grads):
        for name, t in g.items():
            if name in REPLICATED and rank > 0 and inj.norm == "once":
                continue
            total = total + t.double().pow(2).sum()
    return torch.as_tensor(total).sqrt()


def clip_coef(norm: torch.Tensor, inj: Injection) -> float:
    return min(1.0, MAX_GRAD_NORM / (float(norm) + 1e-6)) if inj.clip else 1.0


def _fixture_step(x0, target, base, cfg, inj, seed) -> dict:
    """``check.one_step`` of ``forward_fixture`` (rank 0's loss), with the injection's
    gradient norm and clipping."""
    p = clone_trainable(base)
    x = x0.clone().requires_grad_(True)
    xs = [x] * cfg.world_size
    if inj.inputs == "per_rank":  # ranks 1.. train on batches of their own (constants here)
        xs = [x] + [b[0] for b in rank_batches(cfg, seed, inj)[1:]]
    y = forward_fixture(xs, p, cfg, inj)
    loss = F.mse_loss(y, target)
    loss.backward()
    grads = {k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in p.items()}
    per_rank = shard(grads, cfg, replace(inj, shard="heads" if inj.shard == "fused_naive"
                                          else inj.shard))
    coef = clip_coef(grad_norm(per_rank, inj), inj)
    weights = sgd_step(p, grads, LR, float(coef))
    return {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad,
            "grads": grads, "weights": weights}


def dense_step(x0, target, base, cfg, inj) -> dict:
    """The dense reference of the injection's setup (bias, clipping)."""
    if "bias" not in base and not inj.clip:
        return dense_reference(x0, target, base, cfg)
    p = clone_trainable(base)
    x = x0.clone().requires_grad_(True)
    y = dense_forward(x, p, cfg) + (p["bias"] if "bias" in p else 0)
    loss = F.mse_loss(y, target)
    loss.backward()
    norm = torch.sqrt(sum(t.grad.double().pow(2).sum() for t in p.values()))
    coef = clip_coef(norm, inj)
    weights = sgd_step(p, {k: t.grad for k, t in p.items()}, LR, float(coef))
    return {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad,
            "grads": {k: t.grad for k, t in p.items()}, "weights": weights}


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
    return dense_step(x0, target, base, cfg, inj), tp_step(seed, cfg, inj, simulate), base


def tp_step(seed: int, cfg: Config, inj: Injection, simulate: str = "fixture") -> dict:
    """The TP side of ``run`` in ``check.one_step``'s dict (rank 0's view; full-size
    ``grads``/``weights`` put together from every rank's own tensors under ``"ranks"``;
    ``"fixture"``: ``forward_fixture``'s step)."""
    x0, target = make_inputs(cfg, seed)
    base = make_params(cfg, seed, inj)
    if check_simulate(simulate) == "fixture":
        return _fixture_step(x0, target, base, cfg, inj, seed)
    step = simulated_step(shard(base, cfg, inj), block_inputs(rank_batches(cfg, seed, inj), cfg),
                          cfg, inj, LR)
    return rank0_view(step, cfg, lambda per_rank: unshard(per_rank, cfg, inj))


def run(seed: int = 11, mode: str = EQUIVALENCE, cfg: Config | None = None,
        simulate: str = "fixture") -> dict:
    """``tpattn.run`` for any registry mode: the dense block (with the mode's setup: bias,
    clipping) against the sharded block with the mode's injection, on the five measures."""
    check_seed(seed)
    check_simulate(simulate)
    cfg = Config() if cfg is None else cfg
    entry = check_needs(mode, cfg)
    inj = entry.injection
    x0, target = make_inputs(cfg, seed)
    base = make_params(cfg, seed, inj)
    return five_measures(seed, mode, dense_step(x0, target, base, cfg, inj),
                         tp_step(seed, cfg, inj, simulate))
