"""What a live TP job of the decoder LM can see without a dense twin (tier 1): ``observe_lm``
runs one step of an LM mode on simulated ranks and returns only what each rank could log
(JSON-able; checksums are float64 sums), ``lm_tier1`` the observables it shows, each with
where: the TP ranks' losses disagree, a split weight is the same on every rank, a replicated
parameter differs across ranks after the step, a token's embedding comes from other ranks than
its owner, a token's logit gradient does not sum to zero over the vocabulary, a replicated
bias's gradient is not its output's gradient summed over the tokens, a planned collective is
missing."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Callable

import torch

from tpattn.check.core import LR, check_seed
from tpattn.check.tolerance import UNIT_ROUNDOFF
from tpattn.model.config import LMConfig
from tpattn.model.job import lm_inputs
from tpattn.model.params import MLP_BIAS, layer_key, shard_lm_params
from tpattn.model.tp import LM_CORRECT, LM_REPLICATED, LMProgram, tp_lm_step
from tpattn.parallel.collectives import SimulatedRanks
from tpattn.parallel.engine import stack_ranks, unstack_ranks
from tpattn.bugs.lm_zoo import lm_case
from .observe import LEDGER_KEYS

__all__ = ["LM_LEDGER_KEYS", "ROUNDING_SLACK", "observe_lm", "observe_lm_program",
           "differing_losses", "identical_shards", "differing_replicas", "shared_embeddings",
           "unbalanced_logit_grads", "unsummed_bias_grads",
           "missing_collectives", "LM_TIER1", "lm_tier1"]

#: What an observed LM ledger entry keeps: ``LEDGER_KEYS`` and the stage's ``label``.
LM_LEDGER_KEYS = LEDGER_KEYS + ("label",)
#: How many units of rounding (``UNIT_ROUNDOFF`` of the dtype times the size of the number)
#: two ranks' copies of one number may differ by.
ROUNDING_SLACK = 3


def _checksum(t: torch.Tensor) -> float:
    return float(t.detach().double().sum())


def _kind(key: str, lm: LMConfig) -> str:
    """``"replicated"`` (every TP rank holds it whole), ``"kv"`` (wk/wv replicated over KV
    replica groups: kv_heads < world_size) or ``"sharded"``."""
    name = key.rsplit(".", 1)[-1]
    if name in LM_REPLICATED:
        return "replicated"
    kv = name in ("wk", "wv") and lm.block.kv_heads < lm.block.world_size
    return "kv" if kv else "sharded"


def _sums(ranks: list[dict[str, torch.Tensor]], lm: LMConfig, kind: str) -> dict:
    return {k: [_checksum(r[k]) for r in ranks] for k in ranks[0] if _kind(k, lm) == kind}


def _ledger(entries: list[dict]) -> list[dict]:
    return [{k: e[k] for k in LM_LEDGER_KEYS} for e in entries]


def _recording(cross_entropy: Callable, store: list) -> Callable:
    """``cross_entropy`` as it is, the gradient of its logits ``[R, S, B, V/W]`` appended to
    ``store`` in the backward."""
    def stage(logits, targets, comm, *rest):
        logits.register_hook(store.append)
        return cross_entropy(logits, targets, comm, *rest)
    return stage


def _recording_lookup(lookup: Callable, store: list) -> Callable:
    """``lookup`` as it is, its partials ``[R, S, B, hidden]`` appended to ``store``."""
    def stage(tokens, embed, comm):
        partials = lookup(tokens, embed, comm)
        store.append(partials.detach())
        return partials
    return stage


def _recording_mlp_out(stage: Callable, store: list) -> Callable:
    """The ``mlp_bias`` stage as it is; with a bias, the gradient at its output
    ``[R, S, B, hidden]`` (the dy the bias's gradient sums) put at the layer's forward index
    in ``store``."""
    def recorded(partial, p, comm, g):
        out = stage(partial, p, comm, g)
        if MLP_BIAS in p:
            i = len(store)
            store.append(None)
            out.register_hook(lambda grad: store.__setitem__(i, grad.detach()))
        return out
    return recorded


def _bias_grad_checks(grads: dict[str, torch.Tensor], dys: list) -> dict:
    """Per layer with a bias, per rank: ``gaps`` the largest ``|bias grad - sum over tokens of
    dy|`` (each rank's own tensors, float64) and ``sizes`` the largest ``sum |dy|``."""
    out = {}
    for i, dy in enumerate(dys):
        g, d = grads[layer_key(i, MLP_BIAS)].double(), dy.double()
        out[layer_key(i, MLP_BIAS)] = {
            "gaps": (g - d.sum((1, 2))).abs().amax(-1).tolist(),
            "sizes": d.abs().sum((1, 2)).amax(-1).tolist()}
    return out


def _owners(partials: torch.Tensor) -> list[int]:
    """Per token (flat ``[S * B]``): how many ranks' embedding partials ``[R, S, B, hidden]``
    are not all zero (one all-reduce of a 0/1 flag)."""
    return (partials != 0).any(-1).sum(0).flatten().tolist()


def _logit_grad_sums(grad: torch.Tensor) -> dict:
    """Per token (flat ``[S * B]``) the sum over the whole vocabulary of the loss's logit
    gradient ``grad`` ``[R, S, B, V/W]`` (one all-reduce of the ranks' sums) and of its
    magnitudes."""
    g = grad.double()
    return {"sums": g.sum(-1).sum(0).flatten().tolist(),
            "sizes": g.abs().sum(-1).sum(0).flatten().tolist(),
            "dtype": str(grad.dtype).removeprefix("torch.")}


def observe_lm_program(prog: LMProgram, seed: int = 11, lm: LMConfig | None = None,
                       lr: float = LR, shard: Callable | None = None) -> dict:
    """One step of ``prog`` on simulated ranks, each rank's shards from ``shard(p, lm)``
    (default: the program's ``shard`` stage):
    ``setup`` (with the losses' ``loss_dtype``); ``rank_losses`` ``[W]``; ``shard_checksums``
    (split weights, per rank, as loaded); ``replica_checksums`` (replicated parameters, per
    rank, after the step) and ``replica_update_sizes`` (per rank ``sum |update|``);
    ``embed_owners`` (per token the ranks whose embedding partial is not zero);
    ``logit_grad_sums`` (per token the logit gradient summed over the vocabulary, its
    ``sizes`` and ``dtype``); ``bias_grad_checks`` (``_bias_grad_checks``, empty without
    ``mlp_bias``); ``ledger`` and ``planned_ledger`` (``LM_CORRECT``'s). wk/wv replicated over
    KV replica groups are in neither checksum."""
    check_seed(seed)
    lm = LMConfig() if lm is None else lm
    shard = shard or prog.shard
    p, tokens = lm_inputs(lm, seed)
    w = lm.block.world_size

    def step(program, shards):
        return tp_lm_step(stack_ranks(shards), tokens.expand(w, -1, -1), lm,
                          SimulatedRanks(lm.block, []), lr, program)

    shards, grads, partials, dys = shard(p, lm), [], [], []
    run = step(replace(prog, cross_entropy=_recording(prog.cross_entropy, grads),
                       embed_lookup=_recording_lookup(prog.embed_lookup, partials),
                       mlp_bias=_recording_mlp_out(prog.mlp_bias, dys)), shards)
    plan = step(LM_CORRECT, shard_lm_params(p, lm))
    after = unstack_ranks(run["weights"])
    block = lm.block
    return {"setup": {"program": prog.name, "world_size": w, "layers": lm.layers,
                      "vocab": lm.vocab, "ffn": lm.ffn, "tied": lm.tied, "dtype": block.dtype,
                      "loss_dtype": str(run["losses"].dtype).removeprefix("torch."),
                      "query_heads": block.query_heads, "kv_heads": block.kv_heads},
            "rank_losses": [float(x) for x in run["losses"]],
            "shard_checksums": _sums(shards, lm, "sharded"),
            "replica_checksums": _sums(after, lm, "replicated"),
            "replica_update_sizes": _sums(
                [{k: (a[k] - s[k]).abs() for k in a} for a, s in zip(after, shards)], lm,
                "replicated"),
            "embed_owners": _owners(partials[0]),
            "logit_grad_sums": _logit_grad_sums(grads[0]),
            "bias_grad_checks": _bias_grad_checks(run["grads"], dys),
            "ledger": _ledger(run["ledger"]), "planned_ledger": _ledger(plan["ledger"])}


def observe_lm(mode: str, seed: int = 11, lm: LMConfig | None = None, lr: float = LR) -> dict:
    """``observe_lm_program`` of LM mode ``mode`` (``lm_case``); ``setup`` names the mode.
    ``ValueError`` for a name not in ``LM_REGISTRY``."""
    lm, prog, _ = lm_case(mode, LMConfig() if lm is None else lm)
    obs = observe_lm_program(prog, seed, lm, lr)
    obs["setup"]["mode"] = mode
    return obs


def _rounding(dtype: str, scale: float) -> float:
    """``ROUNDING_SLACK`` units of ``dtype``'s rounding of a number of size ``scale``."""
    return ROUNDING_SLACK * UNIT_ROUNDOFF[dtype] * scale


def differing_losses(obs: dict) -> list[str]:
    """The ranks whose step-0 loss differs from rank 0's by more than its rounding in the
    losses' dtype (every rank's loss comes from the same all-reduced statistics; measured:
    the same bits)."""
    losses = obs["rank_losses"]
    return [f"rank {r}" for r, loss in enumerate(losses)
            if abs(loss - losses[0]) > _rounding(obs["setup"]["loss_dtype"], abs(losses[0]))]


def identical_shards(obs: dict) -> list[str]:
    """The split weights whose checksum is the same on every TP rank (distinct slices of a
    random matrix never are)."""
    return [k for k, sums in obs["shard_checksums"].items() if len(set(sums)) == 1]


def differing_replicas(obs: dict) -> list[str]:
    """The replicated parameters whose checksum after the step differs across ranks by more
    than the rounding of the update (``replica_update_sizes``): replicas get the same
    all-reduced gradient and the same update (measured: the same bits in float32 and float64;
    in bfloat16 at TP 4 at most 0.8 units of ``u * sum |update|`` apart, a dropped f or g at
    least 10)."""
    sizes = obs["replica_update_sizes"]
    return [k for k, sums in obs["replica_checksums"].items()
            if max(sums) - min(sums) > _rounding(obs["setup"]["dtype"], max(sizes[k]))]


def _tokens(flags: list[bool]) -> list[str]:
    """``["k of n tokens"]`` for the ``k`` true ``flags`` of ``n``; ``[]`` when none."""
    k = sum(flags)
    return [f"{k} of {len(flags)} tokens"] if k else []


def shared_embeddings(obs: dict) -> list[str]:
    """``"k of n tokens"`` whose embedding partial is not zero on exactly one rank (its
    vocabulary slice's owner; random rows are never all zero)."""
    return _tokens([owners != 1 for owners in obs["embed_owners"]])


def unbalanced_logit_grads(obs: dict) -> list[str]:
    """``"k of n tokens"`` whose logit gradient does not sum to zero over the vocabulary
    beyond rounding (softmax minus the target distribution sums to 0; measured: correct TP at
    most 1.1 units of ``u * sum |gradient|``, a rank-local or gathered cross-entropy or a target
    logit cut from autograd at least 16); ``[]`` when none."""
    grads = obs["logit_grad_sums"]
    return _tokens([abs(total) > _rounding(grads["dtype"], size)
                    for total, size in zip(grads["sums"], grads["sizes"])])


def unsummed_bias_grads(obs: dict) -> list[str]:
    """The biases whose gradient on some rank differs from that rank's output gradient dy
    summed over the tokens by more than the rounding of ``sum |dy|`` in the step's dtype (a
    bias's gradient is that sum, on every rank that adds it once; measured at TP 2 and 4:
    correct TP at most 0.9 units of ``u * sum |dy|`` in float32 and bfloat16, a bias scaled by
    1/W inside autograd at least 99 in bfloat16)."""
    dtype = obs["setup"]["dtype"]
    return [k for k, c in obs["bias_grad_checks"].items()
            if any(gap > _rounding(dtype, size) for gap, size in zip(c["gaps"], c["sizes"]))]


def missing_collectives(obs: dict) -> list[str]:
    """The planned collectives' labels the ledger holds fewer of than the plan, in plan order."""
    have = Counter(e["label"] for e in obs["ledger"])
    plan = Counter(e["label"] for e in obs["planned_ledger"])
    return [label for label in plan if have[label] < plan[label]]


#: name -> (what it shows, the test returning where: ranks, parameters or collectives).
LM_TIER1: dict[str, tuple[str, Callable[[dict], list[str]]]] = {
    "losses_disagree": ("the TP ranks' step-0 losses differ (a rank computed its loss from "
                        "its own statistics)", differing_losses),
    "shards_identical": ("a split weight holds the same numbers on every TP rank (its shards "
                         "initialised from one seed)", identical_shards),
    "replicas_differ": ("a replicated parameter differs across the TP ranks after one step "
                        "(its gradient was not the same on every rank)", differing_replicas),
    "embedding_not_one_owner": ("a token's embedding partial is not zero on more (or fewer) "
                                "ranks than its vocabulary slice's owner (the lookup's mask)",
                                shared_embeddings),
    "logit_grads_unbalanced": ("the loss's gradient at a token's logits does not sum to zero "
                               "over the vocabulary (the cross-entropy's backward is not "
                               "softmax minus the target)", unbalanced_logit_grads),
    "bias_grad_not_dy_sum": ("a replicated bias's gradient is not the gradient at its output "
                             "summed over the tokens (a rank scaled it, e.g. bias / W inside "
                             "autograd)", unsummed_bias_grads),
    "ledger_short": ("a collective of the plan is missing from the ledger",
                     missing_collectives),
}


def lm_tier1(obs: dict) -> list[dict]:
    """The ``LM_TIER1`` observables ``obs`` shows, in ``LM_TIER1`` order: ``observable``,
    ``shows``, ``where``."""
    out = []
    for name, (shows, test) in LM_TIER1.items():
        where = test(obs)
        if where:
            out.append({"observable": name, "shows": shows, "where": where})
    return out
