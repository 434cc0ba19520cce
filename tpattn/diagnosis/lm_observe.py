"""What a live TP job of the decoder LM can see without a dense twin (tier 1): ``observe_lm``
runs one step of an LM mode on simulated ranks and returns only what each rank could log
(JSON-able; checksums are float64 sums), ``lm_tier1`` the observables it shows, each with
where: the TP ranks' losses disagree, a split weight is the same on every rank, a replicated
parameter differs across ranks after the step, a planned collective is missing."""
from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

from tpattn.check.core import LR, check_seed
from tpattn.check.tolerance import UNIT_ROUNDOFF
from tpattn.model.config import LMConfig
from tpattn.model.job import lm_inputs
from tpattn.model.params import shard_lm_params
from tpattn.model.tp import LM_CORRECT, LM_REPLICATED, LMProgram, tp_lm_step
from tpattn.parallel.collectives import SimulatedRanks
from tpattn.parallel.engine import stack_ranks, unstack_ranks
from tpattn.real.lm_ranks import lm_case
from .observe import LEDGER_KEYS

__all__ = ["LM_LEDGER_KEYS", "ROUNDING_SLACK", "observe_lm", "observe_lm_program",
           "differing_losses", "identical_shards", "differing_replicas", "missing_collectives",
           "LM_TIER1", "lm_tier1"]

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


def observe_lm_program(prog: LMProgram, seed: int = 11, lm: LMConfig | None = None,
                       lr: float = LR, shard: Callable | None = None) -> dict:
    """One step of ``prog`` on simulated ranks, each rank's shards from ``shard(p, lm)``
    (default: the program's ``shard`` stage where it has one, else ``shard_lm_params``):
    ``setup`` (with the losses' ``loss_dtype``); ``rank_losses`` ``[W]``; ``shard_checksums`` (split weights, per rank, as
    loaded); ``replica_checksums`` (replicated parameters, per rank, after the step) and
    ``replica_update_sizes`` (per rank ``sum |update|``); ``ledger`` and ``planned_ledger``
    (``LM_CORRECT``'s). wk/wv replicated over KV replica groups are in neither checksum."""
    check_seed(seed)
    lm = LMConfig() if lm is None else lm
    shard = shard or getattr(prog, "shard", shard_lm_params)
    p, tokens = lm_inputs(lm, seed)
    w = lm.block.world_size

    def step(program, shards):
        return tp_lm_step(stack_ranks(shards), tokens.expand(w, -1, -1), lm,
                          SimulatedRanks(lm.block, []), lr, program)

    shards = shard(p, lm)
    run, plan = step(prog, shards), step(LM_CORRECT, shard_lm_params(p, lm))
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
