"""Part V, TP bugs from the wild (chapters 16-18): the bias, dropout, qk-norm, the mesh, loading,
the ledger and three bug hunts."""
from __future__ import annotations

import copy
import functools
import itertools

import torch

from tpattn.block.dense import dense_forward
from tpattn.block.fused_qkv import fuse_qkv_weight, rank_row_block, read_rank_qkv
from tpattn.block.params import clone_trainable, init_params, shard_params
from tpattn.bugs import zoo
from tpattn.check.core import (EQUIVALENCE, LR, MISSING_INPUT_GRAD_REDUCE,
                               MISSING_OUTPUT_REDUCE, PARAM_SEED_OFFSET, TOLERANCE,
                               block_inputs, dense_reference, dense_step, five_measures,
                               make_inputs, make_params, max_abs_diff, one_step, rank_batches,
                               shard, unshard)
from tpattn.config import Config
from tpattn.exercises.graders import (CHECKED_CONFIGS, EXTRA_SEEDS, Wrong, as_names, cases,
                                      correct_with, counted, exercise, expect_shape, failing,
                                      grade_prediction, keyed, mesh_text, must_pass, near, number,
                                      same_batch_step, shape_text, summed, tensor, tensor_list)
from tpattn.parallel.collectives import SimulatedRanks
from tpattn.parallel.injection import Injection
from tpattn.parallel.rng import RankStreams, simulated_streams
from tpattn.parallel.simulated import mesh_view, rank0_view, simulated_step

AROUND_CHAPTER = 17

# --- chapter 16 -----------------------------------------------------------------------------


def _grade_bias_output(forward, x0, base: dict, dense: dict, cfg: Config, where: str) -> None:
    """``Wrong`` for an output off by W-1 biases or lacking it, or gradients that miss ``p``."""
    b, w = base["bias"], cfg.world_size
    trial = clone_trainable(base)
    out = tensor(forward(x0.clone(), trial, cfg), "your output")
    off = out.detach() - dense["output"]
    expect_shape(off, dense["output"].shape, f"for {shape_text(cfg)} your output")
    if near(off, ((w - 1) * b).expand_as(off), w + 2):
        raise Wrong(f"{where} the output is off by (W-1)·b: the bias is added on every rank "
                    f"before g sums the partials — add it once, after the sum.")
    if near(off, (-b).expand_as(off), w + 2):
        raise Wrong(f"{where} the output lacks the bias: add p['bias'] once, after g.")
    if out.requires_grad:
        out.sum().backward()
    unreached = [k for k, t in trial.items() if t.grad is None]
    if unreached:
        raise Wrong(f"{where} the output is right but no gradient reaches "
                    f"{', '.join(unreached)}: use p's own parameters (no detach, no copy).")


@exercise("add the row-parallel bias once", 16)
def check_bias_once(forward) -> str:
    """Check ``forward(x, p, cfg) -> [S, B, hidden]``: ``tp_forward`` plus ``p["bias"]`` once."""
    inj = Injection(bias="after_g")
    for cfg, seed, x0, target, base in cases(CHECKED_CONFIGS, EXTRA_SEEDS, inj):
        dense = dense_step(x0, target, base, cfg, inj)
        where = f"for seed {seed}, {shape_text(cfg)}"
        _grade_bias_output(forward, x0, base, dense, cfg, where)
        tp = one_step(lambda x, p: forward(x, p, cfg), x0, target, base)
        fails = failing(five_measures(seed, EQUIVALENCE, dense, tp))
        if fails and "forward_max_abs_diff" not in fails:
            raise Wrong(f"{where} the output is right but {', '.join(fails)} fail: the bias must "
                        f"be the parameter p['bias'] itself, so its gradient reaches it.")
        if fails:
            raise Wrong(f"{where} the sharded block fails {', '.join(fails)}.")
    return (f"the bias is added once, after the all-reduce: the block equals dense with its bias "
            f"on all five measures for {len(EXTRA_SEEDS)} seeds × {len(CHECKED_CONFIGS)} shapes.")


@functools.lru_cache(maxsize=None)
def _zoo_forward_hits() -> dict[str, set[bool]]:
    """Per runnable zoo bug: whether its forward output differs from dense's, per hunt shape."""
    from tpattn.diagnosis.hunt import HUNT_SHAPES
    found = {}
    for mode in zoo.runnable_modes():
        inj = zoo.resolve(mode).injection
        if zoo.resolve(mode).is_correct:
            continue
        for cfg, seed in zip(HUNT_SHAPES, EXTRA_SEEDS):
            x0, _ = make_inputs(cfg, seed)
            base = make_params(cfg, seed, inj)
            xs = [x0] * cfg.world_size
            if inj.inputs == "per_rank":
                xs = [x0] + [b[0] for b in zoo.rank_batches(cfg, seed, inj)[1:]]
            with torch.no_grad():
                dense = dense_forward(x0, base, cfg) + base.get("bias", 0)
                hit = max_abs_diff(dense, zoo.forward_fixture(xs, base, cfg, inj)) >= TOLERANCE
            found.setdefault(mode, set()).add(hit)
    return found


@exercise("which zoo bugs the forward shows", 16)
def check_forward_visible(predict) -> str:
    """Check ``predict() -> set``: the runnable zoo bugs whose forward output is not dense's."""
    names = [m for m in zoo.runnable_modes() if not zoo.resolve(m).is_correct]
    predicted = as_names(predict(), names, "zoo bug")
    for mode in names:
        if (mode in predicted) == (True in _zoo_forward_hits()[mode]):
            continue
        if mode in predicted:
            raise Wrong(f"you named {mode}, but its forward output equals dense's on both "
                        f"shapes: it shows only in the backward pass or the step.")
        raise Wrong(f"you left out {mode}: its forward output differs from dense's on both "
                    f"shapes.")
    return (f"right on all {len(names)} zoo bugs, each run on 2 shapes and seeds: exactly "
            f"the ones you named change the forward output.")


# --- chapter 17: dropout (Megatron's RNG discipline) and qk-norm ------------------------------

#: Shapes of the dropout exercises: the original fixture's (p = 0.1), 4 ranks (0.2), a small one.
DROPOUT_CONFIGS = (
    Config(dropout=0.1),
    Config(query_heads=8, kv_heads=4, world_size=4, dropout=0.2),
    Config(seq=3, batch=1, hidden=8, query_heads=6, kv_heads=2, head_dim=2, dropout=0.3),
)
#: The same shapes with qk-norm on (no dropout).
QK_NORM_CONFIGS = tuple(Config(**{**c.as_dict(), "dropout": 0.0, "qk_norm": True})
                        for c in DROPOUT_CONFIGS)


def _stream_seeds(seeds, seed: int, cfg: Config, where: str) -> tuple[list[int], list[int]]:
    """Every rank's residual and attention seeds; ``Wrong`` where two streams coincide."""
    drawn = [keyed(seeds(seed, r), ("residual", "attention")) for r in range(cfg.world_size)]
    residual, attention = ([number(d[k], int, f"the {k} seed should be an int, but it is {{}}.")
                            for d in drawn] for k in ("residual", "attention"))
    if len(set(attention)) < cfg.world_size:
        raise Wrong(f"{where}, two ranks draw their attention masks from the same seed: their "
                    f"heads are different heads, so each rank needs its own stream inside the "
                    f"sharded region (Megatron: seed + 2718 + tp_rank).")
    if set(attention) & set(residual):
        raise Wrong(f"{where}, an attention stream has the residual stream's seed: the two "
                    f"draw different masks and must not replay each other.")
    return residual, attention


@exercise("dropout's two random streams", AROUND_CHAPTER)
def check_dropout_streams(seeds) -> str:
    """Check ``seeds(seed, tp_rank) -> {"residual": int, "attention": int}``: its seeds."""
    for cfg, seed, x0, target, base in cases(DROPOUT_CONFIGS, EXTRA_SEEDS):
        where = f"for seed {seed}, {shape_text(cfg)}"
        residual, attention = _stream_seeds(seeds, seed, cfg, where)

        def streams():
            return RankStreams([torch.Generator().manual_seed(s) for s in residual],
                               [torch.Generator().manual_seed(s) for s in attention])
        drawn = streams()  # the masks the ranks draw, assembled for the dense block
        masks = {"attention": drawn.attention_masks(cfg), "residual": drawn.residual_masks(cfg)[0]}
        step = same_batch_step(base, x0, target, cfg, Injection(), rng=streams())
        must_pass(seed, dense_reference(x0, target, base, cfg, masks), rank0_view(step, cfg),
                  f"{where}, the ranks draw their residual masks from different seeds: every "
                  f"rank holds the whole output after g, so the ranks drop different elements "
                  f"of one replicated tensor and the step fails" if len(set(residual)) > 1
                  else f"{where}, the step fails")
    return (f"the residual stream is the same on every rank and each rank's heads have their "
            f"own: the step equals dense on all five measures for "
            f"{counted(DROPOUT_CONFIGS, EXTRA_SEEDS, ', 2 and 4 ranks')}.")


def _state_list(value, states: list[torch.Tensor]) -> list[torch.Tensor]:
    """``value`` as a generator state per rank, like ``states``, else ``Wrong``."""
    got = tensor_list(value, len(states), states[0].shape, "generator state")
    for r, t in enumerate(got):
        if t.dtype != torch.uint8:
            raise Wrong(f"rank {r}'s generator state should be uint8, like the ones you got.")
    return got


@exercise("re-sync the drifted RNG", AROUND_CHAPTER)
def check_rng_resync(resync) -> str:
    """Check ``resync(states) -> list``: from every TP rank's generator state (uint8) after rank
    0's loader drew from it, the state each continues with."""
    for cfg, seed, x0, target, base in cases(DROPOUT_CONFIGS, EXTRA_SEEDS):
        where = f"for seed {seed}, {shape_text(cfg)}"
        streams = simulated_streams(cfg, seed, Injection(rng="rank0_drift"))
        states = [g.get_state() for g in streams.defaults]
        got = _state_list(resync([s.clone() for s in states]), states)
        if not any(torch.equal(got[0], s) for s in states):
            raise Wrong(f"{where}, rank 0's state is none the ranks had: keep one rank's "
                        f"stream (broadcast it), do not make up a new one.")
        for g, s in zip(streams.defaults, got):
            g.set_state(s.clone())
        step = same_batch_step(base, x0, target, cfg, Injection(), rng=streams)
        apart = max(max_abs_diff(out, step["outputs"][0]) for out in step["outputs"])
        if apart > 0:
            same = all(torch.equal(a, b) for a, b in zip(got, states))
            raise Wrong(f"{where}, the ranks' outputs still differ by {apart:.2g}"
                        + (": the states are the drifted ones, unchanged" if same else
                           ": the ranks continue from different states")
                        + "; every TP rank must draw the residual mask from one state.")
        if len(set(step["losses"].tolist())) != 1:
            raise Wrong(f"{where}, the ranks' losses differ.")
    return (f"every TP rank continues from one state: the residual masks, the outputs and "
            f"the losses agree on all ranks for {counted(DROPOUT_CONFIGS, EXTRA_SEEDS)}. "
            f"Megatron-DeepSpeed PR 276 removed the drift instead: the loader got its own "
            f"generator.")


@exercise("reduce the q/k-norm gradients", AROUND_CHAPTER)
def check_qk_norm_grad_reduce(reduce) -> str:
    """Check ``reduce(grads) -> list``: from every TP rank's ``[head_dim]`` gradient of its
    ``q_norm`` (or ``k_norm``) copy, the gradient each rank steps with."""
    for cfg, seed, x0, target, base in cases(QK_NORM_CONFIGS, EXTRA_SEEDS):
        where = f"for seed {seed}, {shape_text(cfg)}"

        def stage(gq, gk, comm):  # the qk_norm_grads stage: the reader's all-reduce, graded
            return tuple(torch.stack(summed(
                reduce, [t.clone() for t in g.unbind(0)], f"{name} gradient",
                lambda r: f"{where}, rank {r}'s {name} gradient is the ranks' average: each "
                          f"rank's part covers different heads, so they add up.",
                lambda r: f"{where}, rank {r} keeps only its own heads' part of the {name} "
                          f"gradient: the weight is replicated, its gradient needs the TP "
                          f"all-reduce (sum) after backward.",
                lambda r: f"{where}, rank {r}'s {name} gradient is not the sum of the ranks' "
                          f"parts.")) for name, g in (("q_norm", gq), ("k_norm", gk)))

        step = same_batch_step(base, x0, target, cfg, correct_with(qk_norm_grads=stage))
        apart = max(max_abs_diff(step["weights"][k][r], step["weights"][k][0])
                    for k in ("q_norm", "k_norm") for r in range(cfg.world_size))
        if apart > 0:
            raise Wrong(f"{where}, the q/k-norm replicas differ by {apart:.2g} after the step.")
        must_pass(seed, dense_reference(x0, target, base, cfg), rank0_view(step, cfg),
                  f"{where}, the step fails")
    return (f"every rank steps with the sum of the ranks' parts: the q/k-norm replicas stay "
            f"identical and the step equals dense on all five measures for "
            f"{counted(QK_NORM_CONFIGS, EXTRA_SEEDS, ', 2 and 4 ranks')}.")


@exercise("which parameters the missing q/k-norm reduce hits", AROUND_CHAPTER)
def check_qk_norm_hits(predict) -> str:
    """Check ``predict() -> set``: the parameters a missing q/k-norm reduce hits."""
    return grade_prediction(predict, "qk_norm_grad_not_reduced", True, QK_NORM_CONFIGS[:2],
                            EXTRA_SEEDS)


# --- chapter 17: the TP x DP mesh and the sequence gather's group ----------------------------

#: Meshes: TP 2 x DP 2; TP 4 x DP 2; TP 2 x DP 3 (batch 1); TP 2 x DP 2 under SP.
MESH_CONFIGS = (
    Config(data_parallel=2),
    Config(query_heads=8, kv_heads=4, world_size=4, data_parallel=2, seq=4),
    Config(seq=3, batch=1, hidden=8, query_heads=6, kv_heads=2, head_dim=2, data_parallel=3),
    Config(data_parallel=2, sequence_parallel=True, seq=4),
)
#: Meshes of the SP-group exercises: two with DP = TP, as the bug needs, one without.
SP_MESH_CONFIGS = (
    Config(data_parallel=2, sequence_parallel=True, seq=4),
    Config(query_heads=8, kv_heads=4, world_size=4, data_parallel=4, sequence_parallel=True,
           seq=8, batch=1),
    Config(data_parallel=3, sequence_parallel=True, seq=4, batch=1),
)


def _mesh_step(cfg: Config, seed: int, program=None) -> dict:
    """A simulated step of the whole mesh running ``program`` (default: the correct one)."""
    base = make_params(cfg, seed, Injection())
    return simulated_step(shard(base, cfg, Injection()) * cfg.data_parallel,
                          block_inputs(rank_batches(cfg, seed, Injection()), cfg), cfg,
                          program or Injection(), LR)


@exercise("the data-parallel gradient sync", AROUND_CHAPTER)
def check_dp_grad_sync(sync) -> str:
    """Check ``sync(grads) -> list``: the gradient each DP replica steps with."""
    for cfg, seed, x0, target, base in cases(MESH_CONFIGS, EXTRA_SEEDS):
        w, d = cfg.world_size, cfg.data_parallel
        where = f"for seed {seed} on {mesh_text(cfg)}"

        def stage(grads, comm):  # the dp_grads stage: the reader's sync per name and TP rank
            synced = {name: g.clone() for name, g in grads.items()}
            for (name, g), t in itertools.product(synced.items(), range(w)):
                got = summed(
                    sync, [g[r * w + t] for r in range(d)], f"the synced gradient of {name}",
                    lambda r: f"{where}, replica {r} uses the mean of the replicas' {name} "
                              f"gradients: each share is already divided by the global numel "
                              f"(a global-mean loss), so they add up (SUM over the DP group).",
                    lambda r: f"{where}, replica {r} keeps its own {name} gradient (a sync over "
                              f"a group of one rank): the replicas step on different gradients "
                              f"and drift apart.",
                    lambda r: f"{where}, replica {r}'s {name} gradient is neither the sum of "
                              f"the replicas' nor any one of them.")
                for r in range(d):
                    g[r * w + t] = got[r]
            return synced

        step = _mesh_step(cfg, seed, correct_with(dp_grads=stage))
        view = mesh_view(step, cfg, lambda per_rank: unshard(per_rank, cfg, Injection()))
        must_pass(seed, dense_step(x0, target, base, cfg, Injection()), view,
                  f"{where}, the mesh's step fails")
    return (f"every replica steps on the sum of the replicas' gradients, so the replicas "
            f"stay identical and the mesh equals dense on all five measures for "
            f"{counted(MESH_CONFIGS, EXTRA_SEEDS, ', SP among them', unit='meshes', times='x')}.")


def _loss_shares(cfg: Config, seed: int) -> list[float]:
    """Every rank's share of the global mean loss on the mesh."""
    batches = block_inputs(rank_batches(cfg, seed, Injection()), cfg)
    numel = cfg.seq * cfg.batch * cfg.data_parallel * cfg.hidden
    return [float((y.double() - t.double()).pow(2).sum() / numel)
            for y, (_, t) in zip(_mesh_step(cfg, seed)["outputs"], batches)]


@exercise("the logged loss of a TP x DP mesh", AROUND_CHAPTER)
def check_logged_loss(logged) -> str:
    """Check ``logged(shares, cfg) -> float``: the loss to log from every rank's share."""
    for cfg, seed, x0, target, base in cases(MESH_CONFIGS, EXTRA_SEEDS):
        w, d = cfg.world_size, cfg.data_parallel
        shares = _loss_shares(cfg, seed)
        true = float(dense_step(x0, target, base, cfg, Injection())["loss"])
        got = number(logged(list(shares), cfg), (int, float),
                     "your function returned {}; return a float.")
        where = f"for seed {seed} on {mesh_text(cfg)}"
        if abs(got - true) <= 1e-6 * abs(true):
            continue
        if abs(got - w * true) <= 1e-5 * w * abs(true) and not cfg.sequence_parallel:
            raise Wrong(f"{where}, you logged W = {w} times the loss: a sum over the mesh counts "
                        f"each replica's share once per TP rank (the loss all-reduced over the "
                        f"world mesh, pytorch/torchtitan PR 105); sum over the DP group only.")
        own = sum(shares[:w]) if cfg.sequence_parallel else shares[0]
        if abs(got - own) <= 1e-5 * abs(own):
            raise Wrong(f"{where}, you logged replica 0's own share, about 1/{d} of the loss: "
                        f"the DP reduction was skipped (a Replicate DTensor's full_tensor() on "
                        f"the TP mesh, pytorch/torchtitan issue 3280).")
        raise Wrong(f"{where}, you logged {got:.6g}; the global mean loss is {true:.6g}.")
    return (f"the logged loss equals the dense loss on the global batch for "
            f"{counted(MESH_CONFIGS, EXTRA_SEEDS, unit='meshes', times='x')}: one share per "
            f"replica (per rank under SP), summed over the DP group.")


@exercise("the group of the sequence all-gather", AROUND_CHAPTER)
def check_sp_gather_group(group_of) -> str:
    """Check ``group_of(rank, cfg) -> list``: the ranks of ``rank``'s sequence all-gather."""
    for cfg in SP_MESH_CONFIGS:
        comm = SimulatedRanks(cfg)
        for rank in range(cfg.ranks):
            got = group_of(rank, cfg)
            try:
                got = [int(r) for r in got]
            except (TypeError, ValueError):
                raise Wrong(f"your function returned {got!r}; return a list of global "
                            f"ranks.") from None
            want = next(m for m in comm.groups("tp") if rank in m)
            if got == want:
                continue
            where = f"on {mesh_text(cfg)}, for rank {rank}"
            if got == next(m for m in comm.groups("dp") if rank in m):
                raise Wrong(f"{where} you gave its DP group {got}: the same size when DP = TP, "
                            f"so the shapes are right, but the all-gather then mixes other "
                            f"replicas' tokens in (NVIDIA/Megatron-LM issue 7452, "
                            f"CrossAttention's linear_q/linear_kv built without tp_group).")
            if sorted(got) == sorted(want):
                raise Wrong(f"{where} you gave its TP group in the order {got}; the all-gather "
                            f"concatenates in group order {want}, tp rank 0 first.")
            raise Wrong(f"{where} you gave {got}; its TP group is the ranks dp * W + t for "
                        f"t = 0 .. W-1 of its own replica dp.")
    return (f"every rank gathers over its own TP group, in order, on {len(SP_MESH_CONFIGS)} "
            f"meshes ({sum(c.ranks for c in SP_MESH_CONFIGS)} ranks): the gathered sequence is "
            f"its own replica's.")


@exercise("the sequence all-gather on a mesh", AROUND_CHAPTER)
def check_sp_gather_tokens(gather) -> str:
    """Check ``gather(tokens, cfg) -> list``: each rank's gathered ``[S, B, hidden]``."""
    for cfg in SP_MESH_CONFIGS:
        comm = SimulatedRanks(cfg)
        for seed in EXTRA_SEEDS:
            g = torch.Generator().manual_seed(seed)
            tokens = [torch.randn(cfg.local_seq, cfg.batch, cfg.hidden, generator=g)
                      for _ in range(cfg.ranks)]
            got = tensor_list(gather([t.clone() for t in tokens], cfg), cfg.ranks,
                              [cfg.seq, cfg.batch, cfg.hidden], "a gathered sequence")
            want, wrong = (comm.group_cat(torch.stack(tokens), 0, group) for group in ("tp", "dp"))
            where = f"on {mesh_text(cfg)} (seed {seed})"
            for r in range(cfg.ranks):
                if torch.equal(got[r], want[r]):
                    continue
                if torch.equal(got[r], wrong[r]):  # only where DP = TP, else shapes differ
                    raise Wrong(f"{where}, rank {r} gathered over its DP group: the right "
                                f"shape, but chunk by chunk the tokens of every replica "
                                f"(NVIDIA/Megatron-LM issue 7452).")
                raise Wrong(f"{where}, rank {r}'s gathered sequence is not its TP group's "
                            f"tokens in TP order.")
    return (f"every rank's gathered sequence is its own TP group's tokens in order on "
            f"{counted(SP_MESH_CONFIGS, EXTRA_SEEDS, unit='meshes', times='x')}.")


# --- chapter 17: loading a checkpoint into ranks --------------------------------------------

#: Two KV groups per rank; one (where reading the rows as plain [Q; K; V] happens to be right);
#: four groups of three query heads; two groups per rank on 4 ranks.
LOADING_CONFIGS = (
    Config(query_heads=8, kv_heads=4),
    Config(query_heads=8, kv_heads=4, world_size=4),
    Config(seq=3, batch=1, hidden=8, query_heads=24, kv_heads=8, head_dim=2),
    Config(seq=4, query_heads=16, kv_heads=8, world_size=4),
)
_QKV = ("wq", "wk", "wv")


def _grade_loaded(got, w: torch.Tensor, right: list[dict], cfg: Config, rank: int) -> None:
    """``Wrong`` unless ``got`` is ``right[rank]``'s ``(wq, wk, wv)`` as slices of ``w``."""
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise Wrong("your function should return three tensors: (wq, wk, wv).")
    where = f"for rank {rank} of {shape_text(cfg)}"
    for name, t in zip(_QKV, got):
        expect_shape(tensor(t, f"your {name}"), right[rank][name].shape, f"{where} your {name}")

    def same(tensors) -> bool:
        return all(torch.equal(a.detach(), b) for a, b in zip(got, tensors))

    if same([right[rank][k] for k in _QKV]):
        if not all(t.requires_grad for t in got):
            raise Wrong(f"{where} the rows are right but not slices of w: keep them "
                        f"differentiable (no detach, no copy through numpy).")
        return
    if rank > 0 and same([right[0][k] for k in _QKV]):
        raise Wrong(f"{where} you loaded rank 0's rows: narrow at this rank's offset, tp_rank * "
                    f"rows_per_rank (the loader of vllm-gguf-plugin issue 103 never got tp_rank).")
    if same(read_rank_qkv(w.detach()[rank_row_block(cfg, rank)], cfg, "plain")):
        raise Wrong(f"{where} you read the rank's rows as [Q; K; V], but they are "
                    f"{cfg.local_kv_heads} groups [q x {cfg.group_size}; k; v]: split them per "
                    f"group (tenstorrent/tt-metal issue 6243).")
    bad = [k for a, k in zip(got, _QKV) if not torch.equal(a.detach(), right[rank][k])]
    raise Wrong(f"{where} your {', '.join(bad)} rows are not the rank's heads.")


@exercise("load your rank's rows of a grouped QKV checkpoint", AROUND_CHAPTER)
def check_load_grouped_qkv(load) -> str:
    """Check ``load(w, cfg, tp_rank) -> (wq, wk, wv)``: the rank's rows (``[Hq/W*D, hidden]``,
    ``[Hkv/W*D, hidden]`` x 2) as slices of ``w``, fused per KV group (``fuse_qkv_weight``)."""
    for cfg in LOADING_CONFIGS:
        p = init_params(cfg, 7 + PARAM_SEED_OFFSET)
        w = fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, "grouped").requires_grad_(True)
        right = shard_params(p, cfg)
        for rank in range(cfg.world_size):
            _grade_loaded(load(w, cfg, rank), w, right, cfg, rank)
    return (f"every rank of {len(LOADING_CONFIGS)} shapes loads exactly its heads' rows, "
            f"per KV group, as slices of the checkpoint.")


#: The answers of ``check_loading_verdict``: the loading bugs it asks about, or None.
LOADING_VERDICTS = ("qkv_loaded_from_rank0", "grouped_qkv_read_as_plain",
                    "fused_qkv_naive_split", None)
_LOADING_HINTS = {
    "qkv_loaded_from_rank0": "rank 0's Q/K/V are right and every other rank's are off",
    "grouped_qkv_read_as_plain": "every rank's Q, K and V are off but their sum is right: its "
                                 "own rows under the wrong names",
    "fused_qkv_naive_split": "rank 0's query rows are right, its key and value rows are not"}


@functools.lru_cache(maxsize=None)
def _loading_observations() -> tuple:
    """``(name, answer, cfg, seed, shard_checksums, shard_scale)`` of observed runs on two shapes:
    the three loading bugs, correct loads and a made-up wrong rank order (answer None)."""
    from tpattn.diagnosis.observe import observe_injection
    runs = [(m, m, zoo.resolve(m).injection) for m in LOADING_VERDICTS if m is not None]
    runs += [("correct (grouped)", None, Injection(shard="grouped")),
             ("correct (fused)", None, Injection(shard="fused")),
             ("shards in the wrong rank order", None, Injection(shard="fused", shard_offset=1))]
    out = []
    for cfg, seed in ((Config(query_heads=8, kv_heads=4), 5),
                      (Config(seq=4, query_heads=16, kv_heads=8, world_size=4), 11)):
        for name, answer, inj in runs:
            obs = observe_injection(inj, seed, cfg, steps=1, reference=False)
            out.append((name, answer, cfg, seed, obs["shard_checksums"], obs["shard_scale"]))
    return tuple(out)


@exercise("tell the loading bugs apart from the shard checksums", AROUND_CHAPTER)
def check_loading_verdict(verdict) -> str:
    """Check ``verdict(checksums, scale) -> str | None``: the loading bug, or None."""
    for name, answer, cfg, seed, sums, scale in _loading_observations():
        got = verdict(copy.deepcopy(sums), dict(scale))
        if got not in LOADING_VERDICTS:
            raise Wrong(f"you returned {got!r}; return one of "
                        f"{', '.join(map(str, LOADING_VERDICTS))}.")
        if got == answer:
            continue
        where = f"for {name} on {shape_text(cfg)} (seed {seed})"
        if answer is None and all(abs(d) > 1e-5 * max(scale["wo"], 1.0) for d in sums["wo"]):
            raise Wrong(f"{where} you said {got}, but wo is off on every rank too: each rank "
                        f"loaded another rank's whole shard, none of the three bugs.")
        if answer is None:
            raise Wrong(f"{where} you said {got}, but every rank's checksums match its slice: "
                        f"nothing was loaded wrong.")
        raise Wrong(f"{where} you said {got}: {_LOADING_HINTS[answer]}, which is {answer}.")
    return (f"right on all {len(_loading_observations())} observed runs: which ranks are off, "
            f"and whether a rank's Q, K and V sums add up, tell the loaders apart.")


# --- chapter 18 -----------------------------------------------------------------------------

#: The registry bugs that change what the ledger records, by construction of their injection.
_LEDGER_BUGS = (MISSING_OUTPUT_REDUCE, "output_reduced_twice", MISSING_INPUT_GRAD_REDUCE,
                "input_grad_reduced_twice")


@functools.lru_cache(maxsize=None)
def _observed(mode: str, seed: int, cfg: Config, reference: bool, steps: int = 2) -> dict:
    from tpattn.diagnosis.observe import observe
    return observe(mode, seed, cfg, steps=steps, reference=reference)


def _ledger_mistake(obs: dict, mode: str, got, want) -> str:
    """Why ``got`` misreads ``obs``'s ledger (a run of ``mode``; ``want``: the right answer)."""
    counts, plan = ({phase: sum(e["phase"] == phase for e in obs[key])
                     for phase in ("forward", "backward")} for key in ("ledger", "planned_ledger"))
    shown = ", ".join(f"{phase} {counts[phase]} (plan {plan[phase]})" for phase in plan)
    if want is None:
        correct = zoo.resolve(mode).is_correct
        return (f"for {'a correct run' if correct else f'a run of {mode}'} the ledger shows "
                f"{shown} — as planned — but you said {got}: "
                + ("" if correct else "this bug leaves the collectives alone; ") + "answer None.")
    phase = "forward" if counts["forward"] != plan["forward"] else "backward"
    more = "fewer" if counts[phase] < plan[phase] else "more"
    return (f"the ledger shows {shown}, and you said {got}: one all-reduce {more} in the "
            f"{phase} pass is {want}.")


@exercise("read the ledger", 18)
def check_ledger_verdict(verdict) -> str:
    """Check ``verdict(obs) -> str | None``: the bug the ledger shows, or None."""
    from tpattn.diagnosis.hunt import HUNT_SHAPES
    modes = zoo.runnable_modes()
    for mode in modes:
        for cfg, seed in zip(HUNT_SHAPES, EXTRA_SEEDS):
            if mode not in _LEDGER_BUGS and cfg is not HUNT_SHAPES[0]:
                continue  # the counts of these are the plan's on every shape
            obs = _observed(mode, seed, cfg, False, 1)
            got = verdict(copy.deepcopy(obs))
            want = mode if mode in _LEDGER_BUGS else None
            if got == want:
                continue
            if got is not None and got not in _LEDGER_BUGS:
                raise Wrong(f"your function returned {got!r}; return one of "
                            f"{', '.join(_LEDGER_BUGS)}, or None.")
            raise Wrong(_ledger_mistake(obs, mode, got, want))
    return (f"right on observed runs of all {len(modes)} runnable zoo modes (two shapes for "
            f"the four the ledger shows): a count below the plan is a missing reduce, above "
            f"it a doubled one, and the other bugs leave the counts as planned (an averaged f "
            f"changes only its op, to avg).")


#: The hunts of ``check_hunts`` (``tpattn.diagnosis.hunt.hunt_case``): a clipping bug, a bias
#: bug, diverged data and a run with no bug.
HUNTS = (0, 3, 10, 1)


@exercise("three bug hunts and a healthy run", 18)
def check_hunts(guess) -> str:
    """Check ``guess(hunt) -> str``: per hunt of ``HUNTS``, the hidden cause."""
    from tpattn.diagnosis.hunt import choices, hunt_case, judge
    for hunt in HUNTS:
        answer = guess(hunt)
        if answer not in choices():
            raise Wrong(f"for hunt {hunt} you said {answer!r}; name a registry bug or "
                        f"NO_KNOWN_CAUSE ({', '.join(choices())}).")
        mode, seed, cfg = hunt_case(hunt)
        right, why = judge(_observed(mode, seed, cfg, True), mode, answer)
        if not right:
            raise Wrong(f"hunt {hunt}: {why}")
    return (f"right on all {len(HUNTS)} hunts, the healthy run among them: each cause "
            f"named from the observables alone, no dense model.")


def hunt_evidence(hunt: int) -> list[str]:
    """What hunt ``hunt``'s run shows, in words, without naming the cause (``hunt.describe``)."""
    from tpattn.diagnosis.hunt import describe, hunt_case
    mode, seed, cfg = hunt_case(hunt)
    return describe(_observed(mode, seed, cfg, True))
