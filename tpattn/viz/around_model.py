"""Figures of "Around the block": the ranks' dropout masks, the drift of the q/k-norm replicas."""
from __future__ import annotations

from tpattn.check.core import LR, make_inputs, make_params, shard
from tpattn.config import Config
from tpattn.parallel.injection import Injection
from tpattn.parallel.rng import simulated_streams
from tpattn.parallel.simulated import simulated_step
from .style import FAIL_COLOR, PASS_COLOR, new_figure

__all__ = ["residual_masks_by_rank", "dropout_masks_figure", "qk_norm_replica_drift",
           "qk_norm_drift_figure"]


def residual_masks_by_rank(cfg: Config, seed: int, inj: Injection):
    """Every rank's first residual-dropout mask of a step, batch element 0: ``[W, S, hidden]``."""
    return simulated_streams(cfg, seed, inj).residual_masks(cfg)[:, :, 0]


def dropout_masks_figure(cfg: Config, seed: int = 11):
    """The ranks' residual masks (columns) with the RNG synced and with rank 0's drifted."""
    w = cfg.world_size
    fig, axes = new_figure(w, 2, figsize=(min(2.2 * w + 1.0, 6.4), 3.6), squeeze=False)
    rows = (("synced", Injection()), ("rank 0 drifted", Injection(rng="rank0_drift")))
    for i, (label, inj) in enumerate(rows):
        masks = residual_masks_by_rank(cfg, seed, inj)
        for r in range(w):
            ax = axes[i][r]
            ax.imshow((masks[r] > 0).numpy(), cmap="gray", vmin=0, vmax=1, aspect="auto")
            same = bool((masks[r] == masks[1 if w > 1 else 0]).all())
            ax.set_title(f"rank {r}: " + ("= rank 1" if same else "≠ rank 1"), fontsize=9,
                         color=PASS_COLOR if same else FAIL_COLOR)
            ax.set(xticks=[], yticks=[])
            if r == 0:
                ax.set_ylabel(f"{label}\ntokens", fontsize=9)
    fig.suptitle(f"residual dropout masks (p = {cfg.dropout}), batch element 0", fontsize=10)
    return fig


def qk_norm_replica_drift(cfg: Config, seed: int, inj: Injection, steps: int) -> list[float]:
    """After each of ``steps`` SGD steps (``inj``), how far any rank's q/k norms are from rank 0."""
    if not cfg.qk_norm:
        raise ValueError("cfg.qk_norm must be True: the drift is the q/k-norm replicas'")
    x, t = make_inputs(cfg, seed)
    state = shard(make_params(cfg, seed, inj), cfg, inj)
    rng = simulated_streams(cfg, seed, inj) if cfg.dropout > 0 else None
    out = []
    for _ in range(steps):
        step = simulated_step(state, [(x, t)] * cfg.world_size, cfg, inj, LR, rng=rng)
        state = step["weights"]
        out.append(max(float((state[k] - state[k][0]).abs().max()) for k in ("q_norm", "k_norm")))
    return out


def qk_norm_drift_figure(cfg: Config, seed: int = 11, steps: int = 20):
    """``qk_norm_replica_drift`` per step, correct and with the all-reduce skipped."""
    fig, ax = new_figure(figsize=(6.0, 3.0))
    bug = qk_norm_replica_drift(cfg, seed, Injection(qk_norm_grad="none"), steps)
    good = qk_norm_replica_drift(cfg, seed, Injection(), steps)
    x = list(range(1, steps + 1))
    ax.plot(x, bug, color=FAIL_COLOR, marker="o", ms=3, label="gradient all-reduce skipped")
    ax.plot(x, good, color=PASS_COLOR, marker="s", ms=3, label="all-reduced (always 0)")
    ax.set(xlabel="SGD step", ylabel="max |replica − rank 0's|")
    ax.set_title("q/k-norm replicas across TP ranks", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    return fig
