"""What an engineer can see of a TP run without a dense model to compare with: ``observe``
trains the block on simulated ranks and returns only what a real job could log (JSON-able;
checksums are float64 sums), and how the run differs from its correct twin."""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from tpattn.block.kv_layout import kv_grad_bug_applies, replica_groups
from tpattn.check.core import LR, check_seed
from tpattn.config import Config
from tpattn.parallel.engine import REPLICATED, stack_ranks, unstack_ranks
from tpattn.parallel.rng import simulated_streams
from tpattn.parallel.simulated import simulated_forward, simulated_step
from tpattn.bugs.zoo import (Injection, block_inputs, make_params, rank_batches, resolve,
                             shard, unshard)

__all__ = ["observe", "observe_injection", "simulated_train", "train_loop", "replica_sums",
           "STEPS", "LOGGED_LOSSES", "LEDGER_KEYS"]

#: What an observed ledger entry keeps of a collective (``op``: what the program asked for).
LEDGER_KEYS = ("collective", "phase", "group", "op")

#: Training steps of one observation (loss curve length).
STEPS = 3
#: How the job logs its loss: every rank its own, or the ranks' mean on every rank (as
#: Megatron's vocab-parallel cross entropy and torchtitan's loss_parallel do).
LOGGED_LOSSES = ("per_rank", "all_reduced")


def _checksum(t: torch.Tensor) -> float:
    return float(t.detach().double().sum())


def _detached(shards: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [{k: t.detach() for k, t in s.items()} for s in shards]


def replica_sums(weights: list[dict[str, torch.Tensor]], cfg: Config) -> dict[str, list[float]]:
    """Checksums of what must stay identical across ranks (``weights``: every rank's dict):
    replicated parameters, wk/wv per KV replica group (``"wk (ranks 0, 1)"``), on a mesh
    every parameter per DP replica (``"dp wq (tp rank 0)"``)."""
    sums = {name: [_checksum(w[name]) for w in weights] for name in REPLICATED
            if name in weights[0]}
    if cfg.data_parallel > 1:
        w = cfg.world_size
        for name in weights[0]:
            for t in range(w):
                sums[f"dp {name} (tp rank {t})"] = [_checksum(weights[d * w + t][name])
                                                    for d in range(cfg.data_parallel)]
    if kv_grad_bug_applies(cfg):
        for name in ("wk", "wv"):
            for group in replica_groups(cfg):
                key = f"{name} (ranks {', '.join(str(r) for r in group)})"
                sums[key] = [_checksum(weights[r][name]) for r in group]
    return sums


def simulated_train(shards: list[dict[str, torch.Tensor]], batches, cfg: Config,
                    inj: Injection, steps: int, seed: int | None = None) -> dict:
    """``train_loop`` of ``simulated_step`` from ``shards`` on ``batches`` (every rank's); with
    dropout the ranks' streams of ``seed``, and ``rng_checksums``: every rank's generator
    before step 0."""
    rng = simulated_streams(cfg, seed, inj) if cfg.dropout > 0 else None
    def step(p):
        result = simulated_step(p, batches, cfg, inj, LR, rng=rng)
        per_rank = {**result, "losses": list(result["losses"]),
                    "grads": unstack_ranks(result["grads"])}
        return per_rank, result["weights"], unstack_ranks(result["weights"])
    checksums = rng.default_checksums() if rng is not None else None
    return train_loop(stack_ranks(shards), step, steps, cfg, checksums)


def train_loop(state, step, steps: int, cfg: Config, rng_checksums=None) -> dict:
    """An observation's loop: ``step(state) -> (result, state, every rank's weights)``.
    Returns ``first`` (step 0's result), ``curve`` (rank 0's loss per step), ``replicas``
    (``replica_sums`` after step 1 and the last) and the ``rng_checksums`` given, if any."""
    out = {"curve": [], "replicas": {}}
    for i in range(steps):
        result, state, weights = step(state)
        if i == 0:
            out["first"] = result
        out["curve"].append(float(result["losses"][0]))
        if i in (0, steps - 1):
            out["replicas"]["after_1" if i == 0 else "after_k"] = replica_sums(weights, cfg)
    if rng_checksums is not None:
        out["rng_checksums"] = rng_checksums
    return out


def _logged(losses, logged_loss: str) -> list[float]:
    values = [float(l) for l in losses]
    return values if logged_loss == "per_rank" else [sum(values) / len(values)] * len(values)


def _shares(outputs: torch.Tensor, batches, cfg: Config) -> list[float]:
    """On a mesh, every rank's share of the global mean loss at step 0."""
    numel = cfg.seq * cfg.batch * cfg.data_parallel * cfg.hidden
    return [float((y.double() - t.double()).pow(2).sum() / numel)
            for y, (_, t) in zip(outputs, batches)]


def _outside_partials(output: torch.Tensor, good_output: torch.Tensor, shards, xs,
                      cfg: Config, good_inj: Injection, rng=None) -> float:
    """``|d - proj(d)| / |d|``: the part of rank 0's output change ``d`` ``[S, B, hidden]``
    that no combination of the good run's rank partials (before g) and bias makes."""
    d = (output - good_output).double().reshape(-1, 1)
    if float(d.norm()) == 0.0:
        return 0.0
    with torch.no_grad():
        ys = simulated_forward(stack_ranks(shards), xs, cfg, replace(good_inj, g=0, bias=None),
                               rng)
    columns = [(y - x).double().reshape(-1) for y, x in zip(ys, xs)]
    if "bias" in shards[0]:
        columns.append(shards[0]["bias"].double().expand_as(good_output).reshape(-1))
    a = torch.stack(columns, dim=1)
    fit = a @ torch.linalg.lstsq(a, d).solution
    return float((d - fit).norm() / d.norm())


class _Runs(NamedTuple):
    """The live run and its good twin, from one checkpoint ``base``."""
    base: dict
    shards: list
    expected: list
    batches: list
    good_batches: list
    good_inj: Injection
    run: dict
    good: dict


def _check_arguments(seed: int, steps: int, logged_loss: str) -> None:
    check_seed(seed)
    if logged_loss not in LOGGED_LOSSES:
        raise ValueError(f"logged_loss must be one of {', '.join(LOGGED_LOSSES)} "
                         f"(got {logged_loss!r})")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1 (got {steps!r})")


def _train_both(inj: Injection, seed: int, cfg: Config, steps: int, train) -> _Runs:
    """The live run of ``inj`` and its good twin (``inj.correct()``) from one checkpoint."""
    good_inj = inj.correct()
    base = make_params(cfg, seed, inj)
    shards = _detached(shard(base, cfg, inj))
    expected = _detached(shard(base, cfg, good_inj))
    batches = rank_batches(cfg, seed, inj)
    mesh = cfg.data_parallel  # every DP replica holds the TP shards: mesh order
    run = train(shards * mesh, block_inputs(batches, cfg), cfg, inj, steps, seed)
    good_batches = batches if inj.inputs == good_inj.inputs else \
        rank_batches(cfg, seed, good_inj)
    good = run if good_inj == inj else train(
        expected * mesh, block_inputs(good_batches, cfg), cfg, good_inj, steps, seed)
    return _Runs(base, shards, expected, batches, good_batches, good_inj, run, good)


def _reference_observables(runs: _Runs, inj: Injection, seed: int, cfg: Config,
                           logged_loss: str) -> dict:
    """The observables that need the known-good run."""
    first, good_first, w = runs.run["first"], runs.good["first"], cfg.world_size
    grads = unshard(first["grads"][:w], cfg, inj)
    good_grads = unshard(good_first["grads"][:w], cfg, runs.good_inj)
    obs = {"reference": {"rank_losses": _logged(good_first["losses"], logged_loss),
                         "logged_grad_norm": good_first["grad_norm"],
                         "loss_curve": runs.good["curve"]},
           "grad_norm_ratio": {k: float(grads[k].norm() / good_grads[k].norm())
                               for k in good_grads}}
    if not cfg.sequence_parallel and cfg.data_parallel == 1:
        good_xs = [x for x, _ in block_inputs(runs.good_batches, cfg)]
        rng = simulated_streams(cfg, seed, runs.good_inj) if cfg.dropout > 0 else None
        obs["output_outside_partials"] = _outside_partials(
            first["outputs"][0], good_first["outputs"][0], runs.expected, good_xs, cfg,
            runs.good_inj, rng)
    if "bias" in grads:
        shift = (grads["bias"] - good_grads["bias"]).double()
        b = runs.base["bias"].double()
        obs["bias_grad_shift_cosine"] = float(shift @ b / (shift.norm() * b.norm() + 1e-30))
    return obs


def observe_injection(inj: Injection, seed: int = 11, cfg: Config | None = None,
                      steps: int = STEPS, reference: bool = True, logged_loss: str = "per_rank",
                      train=simulated_train) -> dict:
    """``observe`` for any ``Injection``; ``train``: ``simulated_train`` or
    ``observe_real.RealTrain`` (this process is one real rank)."""
    _check_arguments(seed, steps, logged_loss)
    cfg = Config() if cfg is None else cfg
    runs = _train_both(inj, seed, cfg, steps, train)
    first, good_first = runs.run["first"], runs.good["first"]
    obs = {
        "setup": {**inj.setup, "world_size": cfg.world_size, "query_heads": cfg.query_heads,
                  "kv_heads": cfg.kv_heads, "sequence_parallel": cfg.sequence_parallel,
                  "logged_loss": logged_loss},
        "rank_losses": _logged(first["losses"], logged_loss),
        "batch_checksums": [_checksum(x) + _checksum(t) for x, t in runs.batches],
        "shard_checksums": {name: [_checksum(s[name]) - _checksum(e[name])
                                   for s, e in zip(runs.shards, runs.expected)]
                            for name in ("wq", "wk", "wv", "wo")},
        "shard_scale": {name: float(runs.base[name].abs().sum())
                        for name in ("wq", "wk", "wv", "wo")},
        "replica_checksums": runs.run["replicas"],
        "ledger": [{k: e[k] for k in LEDGER_KEYS} for e in first["ledger"]],
        "planned_ledger": [{k: e[k] for k in LEDGER_KEYS} for e in good_first["ledger"]],
        "logged_grad_norm": first["grad_norm"],
        "rank_grad_norms": [{k: float(g.double().norm()) for k, g in grads.items()}
                            for grads in first["grads"]],
        "loss_curve": runs.run["curve"],
    }
    if cfg.dropout > 0:
        obs["setup"]["dropout"] = cfg.dropout
        obs["rng_state_checksums"] = runs.run["rng_checksums"]
    if cfg.qk_norm:
        obs["setup"]["qk_norm"] = True
    if cfg.data_parallel > 1:  # a TP x DP mesh: its degree and every rank's share of the mean
        obs["setup"]["data_parallel"] = cfg.data_parallel
        obs["loss_shares"] = _shares(first["outputs"], block_inputs(runs.batches, cfg), cfg)
    if reference:
        obs.update(_reference_observables(runs, inj, seed, cfg, logged_loss))
    return obs


def observe(mode: str, seed: int = 11, cfg: Config | None = None, steps: int = STEPS,
            reference: bool = True, logged_loss: str = "per_rank", train=simulated_train) -> dict:
    """The observables of a ``steps``-step run of registry ``mode`` on simulated ranks:
    ``setup``; ``rank_losses`` (step 0, as logged: ``LOGGED_LOSSES``); ``batch_checksums``;
    ``shard_checksums`` (per parameter and rank: loaded minus the checkpoint slice; 0 is
    right) and ``shard_scale`` (``sum |w|``); ``replica_checksums`` (``replica_sums`` after
    step 1 and the last); ``ledger`` and ``planned_ledger`` (step 0's collectives, and the
    correct program's); ``logged_grad_norm``; ``rank_grad_norms``; ``loss_curve``; with
    dropout ``rng_state_checksums``; on a mesh ``loss_shares``. With ``reference=True``, the
    good run's ``reference`` losses and norm, ``grad_norm_ratio``, ``bias_grad_shift_cosine``
    and (not SP, not a mesh) ``output_outside_partials``. ``ValueError`` when ``cfg`` does
    not meet the mode's needs."""
    cfg = Config() if cfg is None else cfg
    entry = resolve(mode, cfg, strict=True)
    if entry.injection is None:  # a mode another module runs (zoo.register with a runner)
        raise ValueError(f"mode {mode!r} is run by {entry.provider}: its observables are not "
                         f"an injection of this block")
    return observe_injection(entry.injection, seed, cfg, steps, reference, logged_loss, train)
