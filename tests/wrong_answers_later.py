"""Known-wrong answers to the exercises of chapters 12-17, each with the message it must get.

``tests/frontends/test_exercises.py`` runs them with chapters 5-11's (``WRONG``): one test that every
checker rejects each with its message, one that every checker has at least two. The wrong
answers of chapters 12-17 live here only."""
from __future__ import annotations

import math

import torch

import tpattn
from tpattn import exercises as ex
from tpattn.block.dense import attend_and_project
from tpattn.check.tolerance import ACCUMULATOR, UNIT_ROUNDOFF, fan_in
from tpattn.parallel.tp import copy_to_ranks, reduce_output_partials


def mean_norm(grads):  # norm_grad_averaged
    total = sum(grads) / len(grads)
    return [total.clone() for _ in grads]


def own_norm(grads):  # missing_norm_grad_reduce
    return [g.clone() for g in grads]


def rank0_only_sums(grads):  # sums, but only rank 0 uses it: the replicas drift apart
    return [sum(grads)] + [g.clone() for g in grads[1:]]


def kv_everyone(grads, cfg):  # all-reduce over the whole TP group
    total = sum(grads)
    return [total.clone() for _ in grads]


def kv_group_mean(grads, cfg):
    from tpattn.parallel.kv_heads import replica_groups
    out = [None] * len(grads)
    for group in replica_groups(cfg):
        for r in group:
            out[r] = sum(grads[i] for i in group) / len(group)
    return out


def bound_with(acc_is_stored=False, ranks=True, sqrt=True):
    def bound(cfg):
        u = UNIT_ROUNDOFF[cfg.dtype]
        u_acc = u if acc_is_stored else UNIT_ROUNDOFF[ACCUMULATOR[cfg.dtype]]
        n = fan_in(cfg)
        return u_acc * (math.sqrt(n) if sqrt else n) + u * ((cfg.world_size if ranks else 0) + 4)
    return bound


def classify_with(threshold=None, measures=tpattn.MEASURES):
    def classify(result):
        over = [m for m in measures
                if result[m] > (threshold if threshold is not None else result["bounds"][m])]
        return "bug" if over else "rounding"
    return classify


def split_concat(w, cfg):
    d = cfg.head_dim
    wq, wk, wv = w.split([cfg.query_heads * d, cfg.kv_heads * d, cfg.kv_heads * d])
    q, kv = cfg.local_query_heads * d, cfg.local_kv_heads * d
    return [{"wq": wq[r * q:(r + 1) * q], "wk": wk[r * kv:(r + 1) * kv],
             "wv": wv[r * kv:(r + 1) * kv]} for r in range(cfg.world_size)]


def contiguous_slices(w, cfg):  # fused_qkv_naive_split: rank r reads its rows as [q; k; v]
    d = cfg.head_dim
    q, kv = cfg.local_query_heads * d, cfg.local_kv_heads * d
    return [{"wq": c[:q], "wk": c[q:q + kv], "wv": c[q + kv:]} for c in w.chunk(cfg.world_size)]


def detached(w, cfg):
    return [{k: t.detach() for k, t in s.items()} for s in split_concat(w, cfg)]


def forward_bias(where):
    def forward(x, p, cfg):
        n = tpattn.rms_norm(x, p["norm"], cfg.eps)
        shards = tpattn.shard_params({k: p[k] for k in tpattn.block.params.PARAM_NAMES}, cfg)
        parts = [attend_and_project(n_r, s, cfg) for n_r, s in
                 zip(copy_to_ranks(n, cfg.world_size), shards)]
        if where == "every_rank":
            parts = [part + p["bias"] for part in parts]
        out = x + reduce_output_partials(parts)
        if where == "after_g":
            out = out + p["bias"]
        if where == "constant":  # the bias's values, but not the parameter: no gradient
            out = out + p["bias"].detach()
        return out
    return forward


FORWARD_VISIBLE = {"missing_output_reduce", "output_reduced_twice", "row_bias_on_every_rank",
                   "fused_qkv_naive_split", "repeat_kv_tiled", "inputs_not_replicated"}


def ledger_by_length(obs):  # counts all collectives, not per phase
    got, plan = len(obs["ledger"]), len(obs["planned_ledger"])
    return None if got == plan else ("missing_output_reduce" if got < plan
                                     else "output_reduced_twice")


HUNT_ANSWERS = {0: "grad_norm_counts_replicas", 3: "row_bias_on_every_rank",
                10: "inputs_not_replicated", 1: "no known cause"}

WRONG_LATER = [
    ("check_norm_grad_reduce", mean_norm, "averages the ranks' shares"),
    ("check_norm_grad_reduce", own_norm, "keeps only its own tokens' share"),
    ("check_norm_grad_reduce", rank0_only_sums, "rank 1 keeps only its own tokens' share"),
    ("check_rope_offset", lambda cfg, rank: 0, "as if they started the sequence"),
    ("check_rope_offset", lambda cfg, rank: rank, "but offset 1 rotates them as positions 1..2"),
    ("check_rope_offset", lambda cfg, rank: float(rank), "should be an int"),
    ("check_kv_grad_reduce", lambda grads, cfg: grads, "keeps only its own rank's gradient"),
    ("check_kv_grad_reduce", kv_everyone, "summed over all 4 ranks"),
    ("check_kv_grad_reduce", kv_group_mean, "the replica group's average"),
    ("check_missing_kv_parameters", lambda: {"wk"}, "you left out wv"),
    ("check_missing_kv_parameters", lambda: {"wk", "wv", "wq"}, "you named wq"),
    ("check_relative_bound", bound_with(acc_is_stored=True),
     "the long sums accumulate in the accumulator's precision"),
    ("check_relative_bound", bound_with(ranks=False), "the sum over W ranks' partials"),
    ("check_relative_bound", bound_with(sqrt=False), "grow like sqrt(n), not n"),
    ("check_classify", classify_with(threshold=1e-4), "correct TP (seed 5, bfloat16) is rounding"),
    ("check_classify", classify_with(measures=tpattn.MEASURES[:1]),
     "missing_input_grad_reduce (seed 11, float32) is a bug"),
    ("check_shard_concat_qkv", contiguous_slices,
     "rank 0's wk rows 0..3 are query head 2 of the concatenated weight"),
    ("check_shard_concat_qkv", detached, "the gradients do not reach the dense parameters"),
    ("check_shard_fused_qkv", split_concat,
     "rank 0's wk rows 0..3 are query head 2 of the interleaved weight"),
    ("check_shard_fused_qkv", contiguous_slices,
     "for 8 query / 4 KV heads on 2 ranks, rank 0's wq rows 8..11 are key head 0"),
    ("check_bias_once", forward_bias("every_rank"), "the output is off by (W-1)·b"),
    ("check_bias_once", forward_bias("none"), "the output lacks the bias"),
    ("check_bias_once", forward_bias("constant"), "the output is right but"),
    ("check_forward_visible", lambda: FORWARD_VISIBLE | {"missing_input_grad_reduce"},
     "you named missing_input_grad_reduce, but its forward output equals dense's"),
    ("check_forward_visible", lambda: FORWARD_VISIBLE - {"inputs_not_replicated"},
     "you left out inputs_not_replicated"),
    ("check_forward_visible", lambda: {"missing_f"}, "'missing_f' is not one of the zoo bug"),
    ("check_ledger_verdict", lambda obs: None,
     "the ledger shows forward 0 (plan 1), backward 1 (plan 1), and you said None"),
    ("check_ledger_verdict", ledger_by_length,
     "one all-reduce fewer in the backward pass is missing_input_grad_reduce"),
    ("check_ledger_verdict", lambda obs: "missing_f", "your function returned 'missing_f'"),
    ("check_hunts", lambda hunt: {**HUNT_ANSWERS, 3: "output_reduced_twice"}[hunt],
     "hunt 3: Not output_reduced_twice: it would show"),
    ("check_hunts", lambda hunt: {**HUNT_ANSWERS, 1: "missing_input_grad_reduce"}[hunt],
     "hunt 1: Not missing_input_grad_reduce"),
    ("check_hunts", lambda hunt: {**HUNT_ANSWERS, 0: "no known cause"}[hunt],
     "hunt 0: Not quite: something here does deviate"),
]


# --- the chapter "Around the block": the TP x DP mesh and the gather's group ---------------

def mean_over_replicas(grads):  # DDP's average where the shares already sum to the mean
    total = sum(grads[1:], grads[0]) / len(grads)
    return [total.clone() for _ in grads]


def own_replica(grads):  # dp_grad_group_of_one: a sync over a group of one rank
    return [g.clone() for g in grads]


def dp_group_of(rank, cfg):  # sp_gather_wrong_group: the DP group, the same size
    w = cfg.world_size
    return [d * w + rank % w for d in range(cfg.data_parallel)]


def gather_over_dp(tokens, cfg):  # the same, on the tokens
    w = cfg.world_size
    return [torch.cat(tokens[rank % w::w], dim=0) for rank in range(len(tokens))]


WRONG_LATER += [
    ("check_dp_grad_sync", mean_over_replicas, "uses the mean of the replicas'"),
    ("check_dp_grad_sync", own_replica, "keeps its own"),
    ("check_logged_loss", lambda shares, cfg: sum(shares), "you logged W = 2 times the loss"),
    ("check_logged_loss", lambda shares, cfg: shares[0], "you logged replica 0's own share"),
    ("check_sp_gather_group", dp_group_of, "you gave its DP group"),
    ("check_sp_gather_group", lambda rank, cfg: list(range(cfg.world_size)),
     "for rank 2 you gave [0, 1]"),
    ("check_sp_gather_tokens", gather_over_dp, "gathered over its DP group"),
    ("check_sp_gather_tokens",
     lambda tokens, cfg: [torch.cat(tokens[:cfg.world_size]) for _ in tokens],
     "rank 2's gathered sequence is not its TP group's"),
]


# --- the chapter "Around the block": loading a checkpoint into ranks ------------------------

def _grouped_rows(w, cfg, rank):
    n = w.shape[0] // cfg.world_size
    g, d = cfg.group_size, cfg.head_dim
    rows = w[rank * n:(rank + 1) * n].reshape(cfg.local_kv_heads, (g + 2) * d, -1)
    return tuple(t.reshape(-1, w.shape[1]) for t in rows.split([g * d, d, d], dim=1))


def load_rank0(w, cfg, tp_rank=0):  # qkv_loaded_from_rank0: the rank never reaches the loader
    return _grouped_rows(w, cfg, 0)


def load_as_plain(w, cfg, tp_rank):  # grouped_qkv_read_as_plain
    n = w.shape[0] // cfg.world_size
    rows = w[tp_rank * n:(tp_rank + 1) * n]
    q, kv = cfg.local_query_heads * cfg.head_dim, cfg.local_kv_heads * cfg.head_dim
    return rows[:q], rows[q:q + kv], rows[q + kv:]


def load_detached(w, cfg, tp_rank):  # the right rows, cut off from the checkpoint's graph
    return tuple(t.detach().clone() for t in _grouped_rows(w, cfg, tp_rank))


def verdict_rank0_is_naive(checksums, scale):  # rank 0 right -> the wrong bug's name
    ok = [abs(checksums["wq"][r]) < 1e-5 * max(scale["wq"], 1.0)
          for r in range(len(checksums["wq"]))]
    if all(ok) and all(abs(d) < 1e-5 * max(scale["wk"], 1.0) for d in checksums["wk"]):
        return None
    return "fused_qkv_naive_split" if ok[0] else "grouped_qkv_read_as_plain"


WRONG_LATER += [
    ("check_load_grouped_qkv", load_rank0, "you loaded rank 0's rows"),
    ("check_load_grouped_qkv", load_as_plain, "you read the rank's rows as [Q; K; V]"),
    ("check_load_grouped_qkv", load_detached, "not slices of w"),
    ("check_loading_verdict", lambda checksums, scale: None,
     "you said None: rank 0's Q/K/V are right and every other rank's are off"),
    ("check_loading_verdict", verdict_rank0_is_naive,
     "you said fused_qkv_naive_split: rank 0's Q/K/V are right"),
    ("check_loading_verdict", lambda checksums, scale: "qkv_loaded_from_rank0",
     "which is grouped_qkv_read_as_plain"),
]
