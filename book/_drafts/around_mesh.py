# %% [markdown]
# ## A second mesh dimension: TP x DP
#
# **What you will learn**
#
# - how a job of `world_size * data_parallel` ranks is laid out as a
#   two-dimensional `DeviceMesh` (`("dp", "tp")`, global rank
#   `dp * W + tp`), and which group each collective runs over: f and g
#   over the TP group, the gradient all-reduce over the DP group, the
#   logged loss over the DP group;
# - three public bugs that put a reduction on the wrong group, and what
#   each does to the five measures;
# - what a live job shows of each, with no dense model (tier 1).

# %%
import torch
import tpattn
from tpattn import exercises, viz, Config, MEASURES, TOLERANCE
from tpattn.bugs.modes import resolve
from tpattn.check.core import LR, block_inputs, make_params
from tpattn.check.core import rank_batches, shard
from tpattn.diagnosis.diagnose import diagnose
from tpattn.diagnosis.observe import observe
from tpattn.parallel import collectives, engine
from tpattn.parallel.simulated import replica_views, simulated_step
from tpattn.source import show_source
from tpattn.viz.around_mesh import mesh_groups_figure

# %% [markdown]
# ### The mesh
#
# Data parallelism (DP) gives each of `data_parallel` replicas of the TP
# group its own slice of the global batch: replica `d` trains on batch
# columns `d*B:(d+1)*B`. Each rank's loss is its *share of the global
# mean* (its sum of squares over the global numel), so after backward the
# replicas' gradients **add up**: one all-reduce (SUM) over the DP group.
# The loss the job logs is the same sum of shares, over the same group.
# On real ranks the groups come from PyTorch's `DeviceMesh`
# (`tpattn.real.mesh_ranks`):
#
# ```python
# mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
# mesh.get_group("tp"), mesh.get_group("dp")
# ```
#
# The simulated ranks hold the whole mesh on dim 0 in that order; a
# collective sums over each of its groups:

# %%
show_source(collectives.SimulatedRanks.groups,
            collectives.SimulatedRanks.reduce_dp_grads,
            collectives.SimulatedRanks.reduce_loss)

# %%
cfg = Config(data_parallel=2)  # the seed's block, TP 2 x DP 2
comm = collectives.SimulatedRanks(cfg)
print("TP groups:", comm.groups("tp"), " DP groups:", comm.groups("dp"))
assert comm.groups("tp") == [[0, 1], [2, 3]]
assert comm.groups("dp") == [[0, 2], [1, 3]]

# %% [markdown]
# The training step of a mesh is the engine's own: `engine.train_step`
# takes each rank's share of the global mean, runs backward, then calls
# `mesh_sync` (the DP gradient all-reduce and the logged loss) before the
# gradient norm and the SGD step.

# %%
show_source(engine.mesh_sync)

# %% [markdown]
# ### Three bugs on the wrong group
#
# - **`loss_reduced_over_world`** — pytorch/torchtitan PR 105: in FSDP +
#   SP the loss metric must be all-reduced on the DP submesh; it was
#   all-reduced on the whole 2D world mesh. There it crashed; here the
#   same wrong group, with the shares summed, counts every replica's
#   share once per TP rank: W times the loss.
# - **`loss_full_tensor_tp_only`** — pytorch/torchtitan issue 3280, root
#   cause in PR 3313: `_dist_reduce` returned `x.full_tensor()` for a
#   DTensor, dropping the caller's mesh. The loss is a Replicate DTensor
#   on the TP mesh, so nothing is reduced over DP (PR 3204 measured
#   "loss = true_loss / dp_world_size"); fixed by PR 3159 (`to_local()`,
#   then the mesh all-reduce). On real ranks this book builds exactly that
#   DTensor and calls `full_tensor()`.
# - **`dp_grad_group_of_one`** — ByteDance-Seed/VeOmni issue 1059 (fixed
#   by PR 1086): under Ulysses SP the DDP `dp_group` shrank to one rank,
#   so the gradient all-reduce was a silent no-op and each rank stepped
#   on its own shard's gradient. Here the missing dimension is DP.

# %%
modes = ["equivalence", "loss_reduced_over_world",
         "loss_full_tensor_tp_only", "dp_grad_group_of_one"]
results = [tpattn.run(11, m, cfg, "ranks") for m in modes]
print(viz.measures_table(results, compact=True))
ok, world, tp_only, own = results
assert ok["passed"] and not any(r["passed"] for r in results[1:])
loss_only = [m for m in MEASURES if m != "loss_abs_diff"]
for r in (world, tp_only):  # a metric bug: training itself is right
    assert all(r[m] < TOLERANCE for m in loss_only)
assert own["loss_abs_diff"] < TOLERANCE  # the step-0 loss is right...
assert own["parameter_grad_max_abs_diff"] > 1e-3  # ...the grads not

# %% [markdown]
# The figure shows the groups: top, the correct program's; bottom, each
# bug's (a dotted frame is a group of one rank: nothing is reduced).

# %%
fig = mesh_groups_figure(cfg)

# %% [markdown]
# ### Evidence from the live job
#
# The ledger names each collective's group; the logged loss can be
# compared with the ranks' shares; the DP replicas' weights must stay
# identical. Each bug leaves its mark there, and tier-1 diagnosis (the
# live job alone) names it:

# %%
def ledger_groups(mode):
    inj = resolve(mode, cfg).injection
    base = make_params(cfg, 11, inj)
    step = simulated_step(
        shard(base, cfg, inj) * cfg.data_parallel,
        block_inputs(rank_batches(cfg, 11, inj), cfg), cfg, inj, LR)
    return step, [(e["phase"], e["group"]) for e in step["ledger"]
                  if e["group"] != "tp"]


for mode in modes:
    print(f"{mode:25s}", ledger_groups(mode)[1])
step, _ = ledger_groups("dp_grad_group_of_one")
views = replica_views(step, cfg)
drift = (views[0]["weights"]["wq"] - views[1]["weights"]["wq"])
print("DP replicas' wq apart after one step:", f"{drift.abs().max():.2e}")
assert drift.abs().max() > 0

# %%
for mode in modes[1:]:
    top = diagnose(observe(mode, 5, cfg, reference=False))[0]
    print(f"{mode}: tier-1 diagnosis -> {top['cause']}")
    assert top["cause"] == mode and not top["tied_with"]

# %% [markdown]
# ### Exercise: the data-parallel gradient sync
#
# Write `sync(grads)`: given one parameter's gradient on each DP replica
# (a list of tensors, each replica's share of the gradient of the global
# mean loss), return what every replica must step on. The checker puts
# your answer into a whole mesh's step and compares with dense.

# %%
def sync(grads):
    """One tensor per DP replica in, one per replica out."""
    raise NotImplementedError

# %%
exercises.check_dp_grad_sync(sync)

# %% [markdown]
# A reference solution, and the checker's verdict on it:

# %% tags=["hide-input", "exercise-solution"]
def sync(grads):
    """One tensor per DP replica in, one per replica out."""
    # each share is already over the global numel: they add up
    total = sum(grads[1:], grads[0])
    return [total.clone() for _ in grads]

# %%
exercises.check_dp_grad_sync(sync)

# %% [markdown]
# ### Exercise: the logged loss
#
# Write `logged(shares, cfg)`: given every rank's share of the global
# mean loss (mesh order; without SP each TP rank of a replica holds that
# replica's share, under SP each rank its own tokens'), return the loss
# the job must log.

# %%
def logged(shares, cfg):
    """Every rank's share in, one float out."""
    raise NotImplementedError

# %%
exercises.check_logged_loss(logged)

# %% [markdown]
# A reference solution, and the checker's verdict on it:

# %% tags=["hide-input", "exercise-solution"]
def logged(shares, cfg):
    """Every rank's share in, one float out."""
    w = cfg.world_size
    if cfg.sequence_parallel:  # every rank's own tokens: all of them
        return sum(shares)
    return sum(shares[::w])  # one share per replica: the DP group's sum

# %%
exercises.check_logged_loss(logged)
