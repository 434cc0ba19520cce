"""Part III, real ranks (chapters 11-13): f and g's bytes and counts and f and g on gloo ranks;
the norm gradient and RoPE positions under SP; replicated KV heads' gradients."""
from __future__ import annotations

import torch

from tpattn.block.dense import attend_and_project
from tpattn.block.layers import rms_norm
from tpattn.block.params import init_params, shard_params
from tpattn.check.core import (EQUIVALENCE, LR, MODES, PARAM_SEED_OFFSET, dense_reference,
                               five_measures, make_inputs)
from tpattn.config import Config
from tpattn.exercises.graders import (CHECKED_CONFIGS, CHECKED_SEEDS, EXTRA_SEEDS, Wrong,
                                      cases, correct_with, counted, exercise, failing, first_near,
                                      function_class, grade_prediction, keyed, must_pass, near,
                                      number, reader_list, same_batch_step, shape_text, summed)
from tpattn.parallel.injection import Injection
from tpattn.parallel.simulated import rank0_view, rank_steps, simulated_step

# --- chapter 11 -----------------------------------------------------------------------------


def _recorded_step(cfg: Config, mode: str = EQUIVALENCE) -> tuple[dict, dict]:
    """One step of ``mode``: its all-reduces per phase, the bytes rank 0 hands each by label."""
    from tpattn.parallel.collectives import SimulatedRanks
    from tpattn.parallel.engine import stack_ranks, train_step
    from tpattn.real.ranks import job_setup

    class Measured(SimulatedRanks):
        def group_sum(self, t, group="tp"):
            label = self.ledger[-1]["label"]  # a collective records itself, then sums
            carried[label] = carried.get(label, 0) + t[0].numel() * t.element_size()
            return super().group_sum(t, group)

    carried, comm = {}, Measured(cfg, [])
    inj, _, shards, batches = job_setup(11, mode, cfg)
    train_step(stack_ranks(shards), torch.stack([b[0] for b in batches]),
               torch.stack([b[1] for b in batches]), cfg, inj, comm, LR)
    counts = {phase: sum(e["collective"] == "all_reduce" and e["phase"] == phase
                         for e in comm.ledger) for phase in ("forward", "backward")}
    return counts, carried


#: The checked shapes, a float64 one and a wider one.
BYTES_CONFIGS = CHECKED_CONFIGS + (
    Config(dtype="float64"),
    Config(seq=7, batch=3, hidden=32, query_heads=8, kv_heads=2, head_dim=4, world_size=2),
)


@exercise("bytes f and g move", 11)
def check_bytes_per_step(bytes_per_step) -> str:
    """Check ``bytes_per_step(cfg) -> {"f": int, "g": int}``: the bytes each carries."""
    from tpattn.parallel.collectives import F_LABEL, G_LABEL
    for cfg in BYTES_CONFIGS:
        carried = _recorded_step(cfg)[1]
        want = {"f": carried.get(F_LABEL, 0), "g": carried.get(G_LABEL, 0)}
        got = keyed(bytes_per_step(cfg), ("f", "g"))
        for name in ("f", "g"):
            value = number(got[name], (int, float),
                           f"'{name}' should be a number of bytes, but it is {{}}.")
            if value == want[name]:
                continue
            hint = ""
            if value * 2 == want[name] and cfg.dtype == "float64":
                hint = " — an element's size depends on cfg.dtype"
            elif value * cfg.world_size == want[name]:
                hint = (" — that is divided by the ranks: an all-reduce's tensor is not "
                        "sharded, every rank sends its full-size one")
            raise Wrong(f"for {shape_text(cfg)}, {name}'s all-reduce carries {want[name]} "
                        f"bytes per rank per step; you said {value:g}{hint}.")
    return (f"right for all {len(BYTES_CONFIGS)} shapes, float64 among them: the sizes match "
            f"the tensors the real ranks' f and g hand the ledger.")


@exercise("the ledger's counts", 11)
def check_ledger_counts(ledger_counts) -> str:
    """Check ``ledger_counts(mode) -> {"forward": int, "backward": int}``."""
    for cfg in CHECKED_CONFIGS[:2]:
        for mode in MODES:
            want = _recorded_step(cfg, mode)[0]
            got = keyed(ledger_counts(mode), ("forward", "backward"))
            for phase in ("forward", "backward"):
                if got[phase] != want[phase]:
                    raise Wrong(f"for {mode}, one rank's step issues {want[phase]} "
                                f"all-reduce{'s' if want[phase] != 1 else ''} in the {phase} "
                                f"pass; you said {got[phase]!r}.")
    return (f"right for every mode, on 2 and 4 ranks: the counts match what the ledger records "
            f"when the real ranks' f and g run.")


def _real_fg_rank(rank: int, plan, device, on_progress) -> list | None:
    """One rank of ``check_real_f_and_g``: each seed's step with the reader's f and g; rank 0
    returns the five measures of the gathered steps, the others None."""
    import torch.distributed as dist
    from tpattn.block.params import unshard_params
    from tpattn.check.core import one_step

    cfg, seeds, f, g = plan
    results = []
    for index, seed in enumerate(seeds):
        x0, target = make_inputs(cfg, seed)
        base = init_params(cfg, seed + PARAM_SEED_OFFSET)

        def forward(x, shard):
            n = f.apply(rms_norm(x, shard["norm"], cfg.eps))
            return x + g.apply(attend_and_project(n, shard, cfg))

        step = one_step(forward, x0, target, shard_params(base, cfg)[rank])
        parts = [None] * cfg.world_size  # every rank's grads and weights, on every rank
        dist.all_gather_object(parts, {k: step[k] for k in ("grads", "weights")})
        if rank == 0:
            full = {k: unshard_params([p[k] for p in parts], cfg) for k in ("grads", "weights")}
            results.append(five_measures(seed, EQUIVALENCE,
                                         dense_reference(x0, target, base, cfg),
                                         {**step, **full}))
        on_progress(index)
    return results if rank == 0 else None


@exercise("f and g on real ranks", 11)
def check_real_f_and_g(f_and_g) -> str:
    """Check ``(F, G)``: f and g as autograd Functions, on 2 forked gloo ranks."""
    from tpattn.real.launch import RankFailure, run_on_ranks

    if not isinstance(f_and_g, tuple) or len(f_and_g) != 2:
        raise Wrong("pass the two classes as a tuple (F, G).")
    f, g = f_and_g
    function_class(f, "F")
    function_class(g, "G")
    cfg = Config()
    try:
        results, _ = run_on_ranks(_real_fg_rank, cfg.world_size, (cfg, CHECKED_SEEDS, f, g),
                                  timeout=20.0, backend="gloo", start_method="fork")
    except RankFailure as e:
        text = str(e).removeprefix("real-rank run failed: ")
        if "NotImplementedError" in text:
            raise NotImplementedError from None
        raise Wrong(f"on real ranks, {text}.") from None
    for metrics in results[0]:
        fails = failing(metrics)
        if "forward_max_abs_diff" in fails:
            raise Wrong(f"on real ranks the output is not dense's (seed {metrics['seed']}): "
                        f"G's forward must leave every rank with the sum of all partials.")
        if fails:
            raise Wrong(f"on real ranks the forward is right but {', '.join(fails)} fail "
                        f"(seed {metrics['seed']}): F's backward must all-reduce dn, and G's "
                        f"backward must pass the gradient through unchanged.")
    return (f"on 2 real gloo ranks your F and G give dense's step on all five measures for "
            f"{len(CHECKED_SEEDS)} seeds.")


# --- chapter 12 -----------------------------------------------------------------------------

#: Shapes of the sequence-parallel exercises: 2, 4 and 3 ranks.
SP_CONFIGS = (
    Config(seq=4, sequence_parallel=True),
    Config(seq=8, query_heads=8, kv_heads=4, world_size=4, sequence_parallel=True),
    Config(seq=6, batch=1, hidden=8, query_heads=6, kv_heads=3, head_dim=2, world_size=3,
           sequence_parallel=True),
)


@exercise("the norm-gradient all-reduce under SP", 12)
def check_norm_grad_reduce(finalize) -> str:
    """Check ``finalize(norm_grads) -> list``: the norm gradient each SP rank steps with."""
    for cfg, seed, x0, target, base in cases(SP_CONFIGS, EXTRA_SEEDS):
        w = cfg.world_size
        where = f"for seed {seed}, {shape_text(cfg)}"

        def stage(grad, comm):  # the norm_grad stage: the reader's all-reduce, graded
            return torch.stack(summed(
                finalize, [t.clone() for t in grad.unbind(0)], "norm gradient",
                lambda r: f"{where}, rank {r} averages the ranks' shares, but each is its own "
                          f"tokens' term of one sum: they add up (sum, not mean).",
                lambda r: f"{where}, rank {r} keeps only its own tokens' share: the norm weight "
                          f"sees S/W tokens per rank, so its gradient needs an all-reduce (sum) "
                          f"over the TP group.",
                lambda r: f"{where}, rank {r}'s norm gradient is neither the sum of the ranks' "
                          f"shares nor any one of them."))

        step = simulated_step(shard_params(base, cfg), list(zip(x0.chunk(w), target.chunk(w))),
                              cfg, correct_with(norm_grad=stage), LR)
        must_pass(seed, dense_reference(x0, target, base, cfg), rank0_view(step, cfg),
                  f"{where}, the SP step fails")
    return (f"every rank uses the sum of the ranks' shares, so the norm replicas stay "
            f"equal and the SP step equals dense on all five measures for "
            f"{counted(SP_CONFIGS, EXTRA_SEEDS, ', 2 to 4 ranks')}.")


@exercise("RoPE positions under SP", 12)
def check_rope_offset(offset) -> str:
    """Check ``offset(cfg, rank) -> int``: the position of rank ``rank``'s first token under SP."""
    from tpattn.block.layers import apply_rope
    from tpattn.parallel.sequence_parallel import rank_tokens
    configs = SP_CONFIGS + (Config(seq=12, query_heads=4, kv_heads=4, world_size=4,
                                   sequence_parallel=True),)
    gen = torch.Generator().manual_seed(12)
    for cfg in configs:
        q = torch.randn(cfg.seq, cfg.batch, cfg.query_heads, cfg.head_dim, generator=gen)
        full = apply_rope(q)
        for rank in range(cfg.world_size):
            got = number(offset(cfg, rank), int, "your offset should be an int, but it is {}.")
            tokens = rank_tokens(cfg, rank)
            where = f"for {cfg.world_size} ranks, seq {cfg.seq}"
            if not 0 <= got <= 4 * cfg.seq:
                raise Wrong(f"{where}, rank {rank}: offset {got} is not a position of this "
                            f"sequence.")
            if near(apply_rope(q[tokens], offset=got), full[tokens], 2):
                continue
            first = tokens.start
            hint = (" — that rotates every rank's tokens as if they started the sequence"
                    if got == 0 and first else "")
            raise Wrong(f"{where}: rank {rank} holds positions {first}..{tokens.stop - 1} of the "
                        f"gathered sequence, but offset {got} rotates them as positions "
                        f"{got}..{got + tokens.stop - first - 1}{hint}.")
    return (f"right for every rank of {len(configs)} shapes (2 to 4 ranks): each rank's rotated "
            f"tokens equal the gathered sequence's, so attention sees global positions.")


# --- chapter 13 -----------------------------------------------------------------------------

#: Fewer KV heads than ranks: 2 KV heads on 4 ranks; 1 on 4; 2 on 8.
KV_CONFIGS = (
    Config(query_heads=8, kv_heads=2, world_size=4),
    Config(query_heads=4, kv_heads=1, world_size=4),
    Config(seq=3, batch=1, hidden=8, query_heads=8, kv_heads=2, head_dim=2, world_size=8),
)


def _grade_kv_grads(got: list, own: list, want: list, groups: list, name: str, where: str) -> None:
    """``Wrong`` unless each ``got[r]`` is ``want[r]``, its KV head's gradient."""
    w = len(own)
    everyone = sum(own[1:], own[0])
    for r in range(w):
        group = next(g for g in groups if r in g)
        in_group = sum(own[i] for i in group)
        first_near(got[r], [
            (want[r], w, None),
            (own[r], 1, f"{where}, rank {r}'s copy of {name} keeps only its own rank's gradient; "
                        f"ranks {group} read the same KV head, so the head's gradient is the "
                        f"sum over that replica group."),
            (everyone, w, f"{where}, rank {r}'s {name} gradient is summed over all {w} ranks; "
                          f"the other replica groups hold other KV heads — sum only over its "
                          f"replica group {group}."),
            (in_group / len(group), w, f"{where}, rank {r}'s {name} gradient is the replica "
                                       f"group's average; each replica's gradient is a different "
                                       f"term of the head's gradient, so they add up.")],
            f"{where}, rank {r}'s {name} gradient is not the dense gradient of its KV head's rows.")


@exercise("reduce the KV gradients over the replica group", 13)
def check_kv_grad_reduce(reduce) -> str:
    """Check ``reduce(grads, cfg) -> list``: each copy's gradient of a replicated KV head."""
    from tpattn.parallel.kv_heads import kv_weight_rows, replica_groups
    for cfg, seed, x0, target, base in cases(KV_CONFIGS, EXTRA_SEEDS):
        steps = rank_steps(same_batch_step(base, x0, target, cfg, Injection(kv_grad="none")))
        dense = dense_reference(x0, target, base, cfg)
        for name in ("wk", "wv"):
            own = [s["grads"][name].clone() for s in steps]
            got = reader_list(reduce, own, f"{name} gradient", cfg)
            want = [dense["grads"][name][kv_weight_rows(cfg, r)] for r in range(len(own))]
            _grade_kv_grads(got, own, want, replica_groups(cfg), name,
                            f"for seed {seed}, {shape_text(cfg)}")
    return (f"every rank's copy of wk and wv gets its KV head's full gradient (the sum over "
            f"its replica group) on {2 * len(KV_CONFIGS) * len(EXTRA_SEEDS)} cases: "
            f"{len(EXTRA_SEEDS)} seeds × {len(KV_CONFIGS)} shapes, 4 and 8 ranks.")


@exercise("which parameters a missing KV reduce hits", 13)
def check_missing_kv_parameters(predict) -> str:
    """Check ``predict() -> set``: the parameters with wrong gradients without the KV reduce."""
    from tpattn.check.core import MISSING_KV_GRAD_REDUCE
    return grade_prediction(predict, MISSING_KV_GRAD_REDUCE, True, KV_CONFIGS[:2], EXTRA_SEEDS)
