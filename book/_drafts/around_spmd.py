# %% [markdown]
# ## A gather over the other mesh dimension
#
# **What you will learn**
#
# - that on a TP x DP mesh with `data_parallel == world_size` the two
#   mesh dimensions' groups have the same size, so a collective built on
#   the wrong one runs, with the right shapes, and computes something
#   else;
# - the bug NVIDIA/Megatron-LM issue 7452 found by fuzzing Megatron Core
#   with `spmd_types`, reproduced at its mechanism;
# - why the ledger's group column is the observable that names it.

# %%
import torch
import tpattn
from tpattn import exercises, viz, Config, MEASURES
from tpattn.diagnosis.diagnose import diagnose
from tpattn.diagnosis.observe import observe
from tpattn.parallel import collectives
from tpattn.source import show_source
from tpattn.viz.around_mesh import gathered_sources, sp_gather_figure

# %% [markdown]
# ### The report
#
# NVIDIA/Megatron-LM issue 7452 lists silent numerical bugs, each with a
# 4-rank CPU/gloo reproduction. Its finding
# `06_cross_attention_qkv_wrong_tp_group`: `CrossAttention` builds
# `linear_q` and `linear_kv` without forwarding `tp_group`, so their
# sequence-parallel all-gather runs over the global MPU tensor-parallel
# group and "mixes replicas instead of gathering the module's own
# shards". The output projection keeps its group.
#
# Here: under sequence parallelism (chapter 12) the block's f is the
# all-gather of `n` along the sequence, and its backward a reduce-scatter.
# `sp_gather_wrong_group` (`Injection(sp_group="dp")`) runs both over the
# DP group; the output's reduce-scatter stays on the TP group, as
# `linear_proj` does in the report. The same code, one argument:

# %%
show_source(collectives.SimulatedRanks.gather_sequence,
            collectives.SimulatedRanks.group_cat)

# %% [markdown]
# Which tokens each rank brings home: over its TP group, its own
# replica's chunks in order; over the DP group, chunk `tp` of every
# replica (red frames):

# %%
cfg = Config(data_parallel=2, sequence_parallel=True, seq=4)
fig = sp_gather_figure(cfg)
wrong = gathered_sources(cfg, "dp")
assert wrong[0] == [(0, 0), (1, 0)]  # rank 0: replica 1's tokens too
assert all(len(g) == cfg.world_size for g in wrong)  # shapes right

# %% [markdown]
# ### Evidence
#
# The forward is wrong (another replica's tokens enter the attention),
# so every measure fails; correct TP with SP on the same mesh passes:

# %%
modes = ["equivalence", "sp_gather_wrong_group"]
results = [tpattn.run(11, m, cfg, "ranks") for m in modes]
print(viz.measures_table(results, compact=True))
assert results[0]["passed"]
assert all(results[1][m] > 1e-3 for m in MEASURES)

# %% [markdown]
# Nothing crashes and every shape is right; the ledger says where the
# gather ran, and tier-1 diagnosis reads it:

# %%
obs = observe("sp_gather_wrong_group", 5, cfg, reference=False)
for e, p in zip(obs["ledger"], obs["planned_ledger"]):
    if e != p:
        print(f"{e['phase']:8s} {e['collective']:15s}"
              f" group {e['group']} (plan {p['group']})")
top = diagnose(obs)[0]
print("tier-1 diagnosis:", top["cause"])
assert top["cause"] == "sp_gather_wrong_group"

# %% [markdown]
# ### Exercise: the gather's group
#
# Write `group_of(rank, cfg)`: the global ranks, in order, that the
# sequence all-gather of global rank `rank` must run over on a TP x DP
# mesh (global rank = `dp * W + tp`).

# %%
def group_of(rank, cfg):
    """A global rank in, its group's global ranks out."""
    raise NotImplementedError

# %%
exercises.check_sp_gather_group(group_of)

# %% [markdown]
# A reference solution, and the checker's verdict on it:

# %% tags=["hide-input", "exercise-solution"]
def group_of(rank, cfg):
    """A global rank in, its group's global ranks out."""
    w = cfg.world_size
    dp = rank // w  # its replica: the TP group is that row of the mesh
    return [dp * w + t for t in range(w)]

# %%
exercises.check_sp_gather_group(group_of)

# %% [markdown]
# ### Exercise: the gather itself
#
# Write `gather(tokens, cfg)`: given every rank's own `[S/W, B, hidden]`
# tokens (mesh order), return every rank's gathered `[S, B, hidden]`.

# %%
def gather(tokens, cfg):
    """One tensor per rank in, one per rank out."""
    raise NotImplementedError

# %%
exercises.check_sp_gather_tokens(gather)

# %% [markdown]
# A reference solution, and the checker's verdict on it:

# %% tags=["hide-input", "exercise-solution"]
import torch


def gather(tokens, cfg):
    """One tensor per rank in, one per rank out."""
    w = cfg.world_size
    out = []
    for rank in range(len(tokens)):
        first = rank // w * w  # its TP group: w ranks from here
        out.append(torch.cat(tokens[first:first + w], dim=0))
    return out

# %%
exercises.check_sp_gather_tokens(gather)
