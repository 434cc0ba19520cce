# %% [markdown]
# ## qk-norm: a replicated weight inside the sharded region
#
# **What you will learn**
#
# - qk-norm (RMSNorm over `head_dim` on every query and key head, before RoPE, as Qwen3,
#   OLMo 2 and Gemma 3 do) and why its weights are **replicated** on every TP rank while
#   each rank only sees its own heads;
# - that their gradients need a TP all-reduce after backward, as `norm`'s do under
#   sequence parallelism (Megatron does it in `finalize_model_grads`);
# - the bug `qk_norm_grad_not_reduced`: that all-reduce skipped, the replicas step on
#   partial gradients and drift apart silently — and how a live job shows it.

# %%
import matplotlib.pyplot as plt
import torch

import tpattn
from tpattn import Config, exercises
from tpattn.block import dense
from tpattn.check.core import MEASURES, make_inputs, make_params, shard
from tpattn.diagnosis.diagnose import diagnose
from tpattn.diagnosis.observe import observe
from tpattn.parallel import engine
from tpattn.parallel.injection import Injection
from tpattn.parallel.simulated import simulated_step
from tpattn.source import show_source
from tpattn.viz.around_model import qk_norm_drift_figure

# %% [markdown]
# ### The layer
#
# `Config(qk_norm=True)` adds two weights, `q_norm` and `k_norm`, each `[head_dim]`:
# every query head is RMS-normalized with `q_norm`, every key head with `k_norm`, then
# RoPE rotates them. The dense block:

# %%
show_source(dense.qk_normed_qkv)

# %% [markdown]
# Column-parallel Q and K give rank r its own heads; qk-norm works per head, so rank r
# normalizes its heads with its copy of the weights — no collective in the forward. The
# engine does it for every rank's heads at once:

# %%
show_source(engine.head_norm)

# %% [markdown]
# ### The gradient is a sum over heads
#
# `q_norm` multiplies every query head, so its gradient is a sum over all heads. Rank r's
# backward only sees its own heads: its gradient is one part of the sum. The correct
# program all-reduces the parts after backward; the engine does it in one collective for
# both weights (skipped only under `qk_norm_grad="none"`):

# %%
show_source(engine.reduce_qk_norm_grads)

# %%
cfg = Config(qk_norm=True)
seed = 11
x, t = make_inputs(cfg, seed)
base = make_params(cfg, seed, Injection())


def step_of(inj):
    batches = [(x, t)] * cfg.world_size
    return simulated_step(shard(base, cfg, inj), batches, cfg, inj, 0.05)


good = step_of(Injection())
bad = step_of(Injection(qk_norm_grad="none"))
parts = bad["grads"]["q_norm"]  # [ranks, head_dim]: each rank's own heads
torch.testing.assert_close(parts.sum(0), good["grads"]["q_norm"][0],
                           rtol=1e-5, atol=1e-7)
print("rank parts of dL/dq_norm:\n", parts)
print("all-reduced:", good["grads"]["q_norm"][0])
for entry in good["ledger"]:
    print(entry["phase"], "|", entry["label"])

# %% [markdown]
# ### Correct TP with qk-norm passes; the bug fails two measures
#
# NVIDIA-NeMo/RL issue 3716 (open): the split-API train step of `MegatronPolicyWorker`
# finalizes gradients by hand and bypasses megatron-core's `finalize_model_grads`, and
# with it the TP SUM for replicated parameters whose raw gradients are per-rank partial
# sums — the q/k layernorm weights of the Qwen3 family among them. "These replicas
# silently diverge one optimizer step at a time — no crash, no NaN, pure drift."
# `qk_norm_grad_not_reduced` skips that all-reduce at the same place, after backward:

# %%
for mode in ("equivalence", "qk_norm_grad_not_reduced"):
    r = tpattn.run(11, mode, cfg, simulate="ranks")
    print(f"{mode}:")
    for m in MEASURES:
        print(f"  {m:32s} {r[m]:.2e}")
bug = tpattn.run(11, "qk_norm_grad_not_reduced", cfg, simulate="ranks")
assert all(bug[m] < 1e-6 for m in MEASURES[:3])
assert bug["parameter_grad_max_abs_diff"] > 1e-3

# %% [markdown]
# The forward, the loss and the input gradient are exact: nothing changes until the
# optimizer steps. Then each replica moves by its own part, and they drift further
# apart with every step:

# %%
fig = qk_norm_drift_figure(cfg, seed=11, steps=20)
plt.show()

# %% [markdown]
# ### What the live job shows
#
# The ledger misses the after-backward all-reduce the plan has, and the q/k-norm
# replicas' checksums differ after one step: the live job alone names the cause.

# %%
obs = observe("qk_norm_grad_not_reduced", seed=500, cfg=cfg, reference=False)
def after_backward(ledger):
    return sum(e["phase"] == "after backward" for e in ledger)


print("after backward, plan:", after_backward(obs["planned_ledger"]),
      "| issued:", after_backward(obs["ledger"]))
print("q_norm replicas after 1 step:",
      obs["replica_checksums"]["after_1"]["q_norm"])
top = diagnose(obs)[0]
print("diagnosis:", top["cause"], "| tied:", top["tied_with"])
assert top["cause"] == "qk_norm_grad_not_reduced" and not top["tied_with"]

# %% [markdown]
# ### Exercise: reduce the q/k-norm gradients
#
# Write `reduce_qk_grads(grads)`: given every TP rank's gradient of its copy of `q_norm`
# (or `k_norm`) after backward — a list of `[head_dim]` tensors, rank order, each the
# part of that rank's heads — return the gradient each rank must step with. The checker
# runs it inside the engine's train step on 2 and 4 ranks.

# %%
def reduce_qk_grads(grads):
    """One gradient per rank in, one per rank out."""
    raise NotImplementedError

# %%
exercises.check_qk_norm_grad_reduce(reduce_qk_grads)

# %% [markdown]
# A reference solution (in the book, click to show it), and the checker's verdict on it:

# %% tags=["hide-input", "exercise-solution"]
def reduce_qk_grads(grads):
    """One gradient per rank in, one per rank out."""
    total = sum(grads[1:], grads[0])  # the TP all-reduce (sum)
    return [total.clone() for _ in grads]

# %%
exercises.check_qk_norm_grad_reduce(reduce_qk_grads)

# %% [markdown]
# ### Exercise: which gradients the missing reduce gets wrong
#
# Write `predict_qk_hits()`: the set of parameter names (`norm`, `wq`, `wk`, `wv`, `wo`,
# `q_norm`, `k_norm`) whose gradients, as rank 0 reports them, are wrong under
# `qk_norm_grad_not_reduced`.

# %%
def predict_qk_hits():
    """A set of parameter names."""
    raise NotImplementedError

# %%
exercises.check_qk_norm_hits(predict_qk_hits)

# %% [markdown]
# A reference solution (in the book, click to show it), and the checker's verdict on it:

# %% tags=["hide-input", "exercise-solution"]
def predict_qk_hits():
    """A set of parameter names."""
    return {"q_norm", "k_norm"}  # every other gradient is summed as before

# %%
exercises.check_qk_norm_hits(predict_qk_hits)
