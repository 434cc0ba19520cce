"""The check at real sizes: every world size and mode against one dense step per seed, under
``tolerance="auto"`` bounds, and a dtype against float64."""
from __future__ import annotations

from dataclasses import replace

from .core import (LR, PARAM_SEED_OFFSET, dense_reference, five_measures, make_inputs,
                   one_step, probe_step, tp_step)
from tpattn.config import Config
from tpattn.block.params import init_params
from tpattn.parallel.injection import Injection
from tpattn.parallel.one_graph import one_graph_forward
from .magnitude import gradient_magnitudes
from .tolerance import (amplification, apply_auto, parameter_amplification, per_parameter,
                        ratios, rounding_floors)


def probe_amplification(cfg: Config, x0, target, base: dict, dense: dict) -> dict:
    """``tolerance.amplification`` of ``cfg``'s step (``probe_step`` against ``dense``)."""
    return amplification(cfg, dense, probe_step(cfg, x0, target, base))


def compare_world_sizes(cfg: Config, seed: int, programs, world_sizes=(1, 2, 4, 8),
                        init: str = "fan_in", path: str = "batched",
                        probe: bool = False) -> list[dict]:
    """One dense step, then a TP step (``path``: ``"loop"``, ``tp_step``; ``"batched"``,
    ``one_graph_forward``) per world size x program (bugs skipped at world size 1), the probe
    run once when first needed (or ``probe=True``). One dict per TP step: ``run(tolerance=
    "auto")``'s keys, ``world_size``, ``dtype``, ``init``, ``ratios``; once probed also
    ``amplification_by`` and ``floor_ratios``."""
    x0, target = make_inputs(cfg, seed)
    base = init_params(cfg, seed + PARAM_SEED_OFFSET, init)
    dense = dense_reference(x0, target, base, cfg)
    dense["grad_magnitudes"] = gradient_magnitudes(x0, target, base, cfg)
    amp, by_name = {}, {}

    def measure():  # the probe, once: A_m by measure and A_p by parameter
        if not amp:
            step = probe_step(cfg, x0, target, base)
            by_name.update(parameter_amplification(cfg, dense, step))
            amp.update(amplification(cfg, dense, step, by_name))
    if probe:
        measure()
    rows = []
    for w in world_sizes:
        cfg_w = replace(cfg, world_size=w)
        for program in programs:
            inj = program.injection
            if w == 1 and inj != Injection():
                continue
            step = tp_step(x0, target, base, cfg_w, inj) if path == "loop" else one_step(
                lambda x, p: one_graph_forward(x, p, cfg_w, inj), x0, target, base)
            metrics, bounds = per_parameter(cfg_w, five_measures(seed, program.name, dense, step),
                                            dense, step, LR)
            worst = metrics["worst_parameter"]

            def floors():  # called at once by apply_auto, only when a bound is exceeded
                measure()
                return rounding_floors(cfg_w, dense, amp, LR, worst, by_name), amp
            row = apply_auto(metrics, bounds, floors)
            row.update(world_size=w, dtype=cfg.dtype, init=init,
                       ratios=ratios(row, bounds))
            if amp:
                row.update(amplification_by=dict(amp), floor_ratios=ratios(
                    row, rounding_floors(cfg_w, dense, amp, LR, worst, by_name)))
            rows.append(row)
    return rows


def against_float64(cfg: Config, seed: int, init: str = "fan_in") -> dict:
    """The dense step in ``cfg.dtype`` against float64: the five measures, bounds, ratios."""
    x0, target = make_inputs(cfg, seed)
    base = init_params(cfg, seed + PARAM_SEED_OFFSET, init)
    low = dense_reference(x0, target, base, cfg)
    cfg64 = replace(cfg, dtype="float64")
    exact = dense_reference(x0.double(), target.double(),
                            {k: v.double() for k, v in base.items()}, cfg64)
    exact["grad_magnitudes"] = gradient_magnitudes(x0, target, base, cfg)
    as64 = {k: ({n: t.double() for n, t in v.items()} if isinstance(v, dict) else v.double())
            for k, v in low.items()}
    row, bounds = per_parameter(cfg, five_measures(seed, "dense_vs_float64", exact, as64),
                                exact, as64, LR)
    row = apply_auto(row, bounds)
    row.update(dtype=cfg.dtype, init=init, ratios=ratios(row, bounds))
    return row


def llama3_8b_attention(seq: int = 64, dtype: str = "float32", world_size: int = 8) -> Config:
    """The Llama-3-8B attention block's shape: hidden 4096, 32 query / 8 KV heads of 128."""
    return Config(seq=seq, batch=1, hidden=4096, query_heads=32, kv_heads=8, head_dim=128,
                  world_size=world_size, dtype=dtype)

