# %% [markdown]
# ## Dropout across TP ranks: one stream outside, one per rank inside
#
# **What you will learn**
#
# - where dropout sits in the block (the attention probabilities, inside the sharded
#   region; the block's output before the residual add, outside it) and which random
#   stream each draws from, as Megatron's model-parallel RNG tracker does;
# - that correct TP with dropout still equals the dense block on all five measures, when
#   the dense block applies the masks the ranks draw;
# - the bug `dropout_rng_desync`: the data loader on tp_rank 0 draws its workers' base
#   seed from the torch RNG, so tp_rank 0's `nn.Dropout` masks differ from the other
#   ranks' while the data are identical — and how a live job shows it.

# %%
import matplotlib.pyplot as plt
import torch

import tpattn
from tpattn import Config, exercises
from tpattn.check.core import MEASURES
from tpattn.diagnosis.diagnose import diagnose
from tpattn.diagnosis.observe import observe
from tpattn.parallel.injection import Injection
from tpattn.parallel.rng import simulated_streams
from tpattn.source import show_source
from tpattn.viz.around_model import dropout_masks_figure

# %% [markdown]
# ### Two streams per rank
#
# Dropout draws a mask; every rank draws its own. Which masks must agree? After g every TP
# rank holds the whole output of the attention block: a replicated tensor. Dropping
# different elements of it on different ranks would give each rank a different output,
# so the **residual dropout** must draw the same mask on every TP rank. The attention
# probabilities are sharded by heads: rank r holds its own heads only, and their masks
# should be independent draws, so the **attention dropout** needs a different stream on
# every rank.
#
# Megatron-LM keeps both (`tensor_parallel/random.py`,
# `model_parallel_cuda_manual_seed`): the default generator is seeded with `seed` on
# every TP rank, and the tracker's `"model-parallel-rng"` with `seed + 2718 + tp_rank`;
# dropout inside the sharded region runs under `get_cuda_rng_tracker().fork()`. The
# package keeps the same two generators per rank:

# %%
from tpattn.parallel import rng as rng_module

show_source(rng_module.simulated_streams)

# %% [markdown]
# The engine multiplies the attention probabilities of rank r's heads by a mask from
# rank r's model-parallel stream, and the block's output (after g) by a mask from the
# rank's default stream. Kept elements are scaled by 1/(1-p):

# %%
show_source(rng_module.keep_mask)

# %%
cfg = Config(dropout=0.1)
streams = simulated_streams(cfg, seed=11)
att = streams.attention_masks(cfg)  # [B, heads rank-major, S, S]
res = streams.residual_masks(cfg)  # [ranks, S, B, hidden]
per_rank = att.view(cfg.batch, cfg.world_size, -1, cfg.seq, cfg.seq)
assert torch.equal(res[0], res[1])  # outside: the same mask on both ranks
assert not torch.equal(per_rank[:, 0], per_rank[:, 1])  # inside: its own
print("kept fraction of the residual mask:",
      f"{float((res[0] > 0).float().mean()):.3f} (p = {cfg.dropout})")

# %% [markdown]
# ### Correct TP with dropout passes
#
# The dense block has no ranks; it applies the masks the ranks draw, put together
# (`rng.replica_masks`: rank r's attention masks for its heads, the one residual mask).
# Then the sharded block equals it on every measure, on both simulations:

# %%
rows = []
for c in (Config(dropout=0.1),
          Config(query_heads=8, kv_heads=4, world_size=4, dropout=0.2)):
    for simulate in ("fixture", "ranks"):
        r = tpattn.run(11, "equivalence", c, simulate=simulate)
        assert r["passed"]
        rows.append((c.world_size, simulate, max(r[m] for m in MEASURES)))
for w, sim, worst in rows:
    print(f"W={w} {sim:8s} largest of the five measures: {worst:.1e}")

# %% [markdown]
# (`simulate="fixture"` has no random streams of its own: with dropout on, the package
# runs the simulated ranks and reports rank 0's view — a simulation's shortcut.)
#
# ### The bug: tp_rank 0's RNG drifts
#
# bigscience-workshop/Megatron-DeepSpeed PR 276 (merged; upstreamed as
# NVIDIA/Megatron-LM PR 206, not merged): the BLOOM team found `torch_rng_state`
# differing across TP ranks. The data loader is built on tp_rank 0 only, and creating
# its iterator draws the workers' `base_seed` from the torch RNG — so tp_rank 0 consumes
# one draw the other ranks do not, and every `nn.Dropout` after it drops other elements
# on tp_rank 0. The data stay identical. The fix gave the loader its own generator.
#
# `dropout_rng_desync` reproduces that mechanism: tp_rank 0's default generator goes
# through a real `torch.utils.data.DataLoader` iterator before the step
# (`_BaseDataLoaderIter` draws `base_seed` with `random_(generator=...)`):

# %%
show_source(rng_module.drift_by_loader)

# %%
fig = dropout_masks_figure(Config(dropout=0.1), seed=11)
plt.show()

# %% [markdown]
# The five measures: rank 0 applies a residual mask the correct program does not draw,
# so its output, its loss and every gradient that flows from them differ from dense.

# %%
bug = tpattn.run(11, "dropout_rng_desync", Config(dropout=0.1),
                 simulate="ranks")
for m in MEASURES:
    print(f"{m:32s} {bug[m]:.2e}")
assert not bug["passed"] and bug["forward_max_abs_diff"] > 1e-2

# %% [markdown]
# ### What the live job shows
#
# No dense twin at hand: the job logs per-rank losses, batch checksums and — what the
# report compared — a checksum of each rank's default RNG state when the step starts.
# The batches agree, the RNG states do not; the diagnosis (tier 1, the live job alone)
# names the cause:

# %%
obs = observe("dropout_rng_desync", seed=500, cfg=Config(dropout=0.1),
              reference=False)
print("batch checksums:", [round(c, 4) for c in obs["batch_checksums"]])
print("RNG state checksums:", obs["rng_state_checksums"])
print("rank losses:", [round(l, 4) for l in obs["rank_losses"]])
top = diagnose(obs)[0]
print("diagnosis:", top["cause"], "| tied:", top["tied_with"])
assert len(set(obs["batch_checksums"])) == 1
assert top["cause"] == "dropout_rng_desync"

# %% [markdown]
# On real `torch.distributed` ranks the same happens with torch's global RNG: every rank
# calls `torch.manual_seed(seed)`, tp_rank 0 alone creates a `DataLoader` iterator with
# the default generator, and the residual dropout draws from that global RNG
# (`tests/real/test_model_options_real.py` checks the five measures and the observables
# equal the simulated ranks').
#
# ### Exercise: dropout's two random streams
#
# Write `seeds(seed, tp_rank)`: the seeds of the generators TP rank `tp_rank` draws its
# residual-dropout mask and its attention-dropout masks from, as
# `{"residual": int, "attention": int}`. The checker runs the step with them on 2 and 4
# ranks and compares with the dense block.

# %%
def seeds(seed, tp_rank):
    """The residual and attention streams' seeds of one TP rank."""
    raise NotImplementedError

# %%
exercises.check_dropout_streams(seeds)

# %% [markdown]
# A reference solution (in the book, click to show it), and the checker's verdict on it:

# %% tags=["hide-input", "exercise-solution"]
def seeds(seed, tp_rank):
    """The residual and attention streams' seeds of one TP rank."""
    return {"residual": seed,  # the same on every TP rank
            "attention": seed + 2718 + tp_rank}  # Megatron's tracker

# %%
exercises.check_dropout_streams(seeds)

# %% [markdown]
# ### Exercise: re-sync the drifted RNG
#
# Write `resync(states)`: given every TP rank's default-generator state
# (`torch.Generator.get_state()`) after tp_rank 0's loader drew from it, return the state
# each rank must continue with, so that every rank draws the same residual mask.

# %%
def resync(states):
    """One generator state per rank in, one per rank out."""
    raise NotImplementedError

# %%
exercises.check_rng_resync(resync)

# %% [markdown]
# A reference solution (in the book, click to show it), and the checker's verdict on it:

# %% tags=["hide-input", "exercise-solution"]
def resync(states):
    """One generator state per rank in, one per rank out."""
    return [states[0].clone() for _ in states]  # broadcast tp_rank 0's state

# %%
exercises.check_rng_resync(resync)
