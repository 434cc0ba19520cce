# %% [markdown]
# ## Loading a checkpoint into ranks
#
# **What you will learn**
#
# - the two row orders of a fused QKV checkpoint: plain `[Wq; Wk; Wv]`
#   and fused per KV group (Megatron-Core's `linear_qkv`, Falcon-40B's),
#   and how each rank narrows its rows out of either;
# - two public loading bugs where every shape is right and the numbers
#   are not: a loader that never got its rank, and a rank's rows read in
#   the wrong order;
# - what the five measures say, and what a live job shows of each with
#   no dense model (tier 1): the shard checksums.

# %%
import torch
import tpattn
from tpattn import exercises, Config, MEASURES, TOLERANCE
from tpattn.block import fused_qkv
from tpattn.block.params import init_params, shard_params
from tpattn.check.core import check_injection, load_rank_shard
from tpattn.diagnosis.diagnose import diagnose, features
from tpattn.diagnosis.observe import observe
from tpattn.parallel.injection import Injection
from tpattn.source import show_source
from tpattn.viz.around_loading import loaded_rows_figure
from tpattn.viz.tables import measures_table

# %% [markdown]
# ### Two row orders of one weight
#
# A checkpoint often keeps Q, K and V as one weight of
# `(Hq + 2 Hkv) * D` rows. In the *plain* order it is `[Wq; Wk; Wv]`.
# Megatron-Core and Falcon-40B fuse it *per KV group*: for each group
# its `Hq/Hkv` query heads, then its key head, then its value head. In
# that order a rank's complete groups are one contiguous block of `1/W`
# of the rows, so a loader narrows one block and splits it per group.
# In the plain order it narrows Q, K and V each at the rank's offset.
# The package's loader does both; like the one in the first report
# below, it reads the rank from its keyword arguments, default 0:

# %%
show_source(fused_qkv.fuse_qkv_weight, fused_qkv.read_rank_qkv,
            fused_qkv.load_qkv_weight)

# %%
cfg = Config(query_heads=8, kv_heads=4)  # two KV groups per rank
p = init_params(cfg, 3)
qkv = (p["wq"], p["wk"], p["wv"])
for layout in fused_qkv.FUSED_LAYOUTS:
    w = fused_qkv.fuse_qkv_weight(*qkv, cfg, layout)
    back = fused_qkv.split_qkv_weight(w, cfg, layout)
    assert all(torch.equal(a, b) for a, b in zip(back, qkv))
    for rank, own in enumerate(shard_params(p, cfg)):
        mine = fused_qkv.load_qkv_weight(w, cfg, layout, tp_rank=rank)
        assert all(torch.equal(a, own[k])
                   for a, k in zip(mine, ("wq", "wk", "wv")))
print("both layouts round-trip; with its tp_rank every rank loads",
      "its own heads")

# %% [markdown]
# ### Two loaders that get the shapes right
#
# **`qkv_loaded_from_rank0`** (vllm-project/vllm-gguf-plugin issue 103,
# fixed by PR 106): the plugin's `load_qkv_weight` and
# `load_merged_column_weight` took `tp_rank = kwargs.get("tp_rank", 0)`,
# and vLLM's `weight_loader_v2` never passes `tp_rank`. Every rank
# narrowed rank 0's rows: right shapes, no error, wrong output at
# `tensor_parallel_size > 1`. The fix asks the process group for the
# rank. Here the checkpoint is the plain `[Wq; Wk; Wv]`, and each rank's
# loader is called the way the buggy caller called it:

# %%
show_source(load_rank_shard)

# %% [markdown]
# **`grouped_qkv_read_as_plain`** (tenstorrent/tt-metal issue 6243,
# closed): in Falcon-40B's attention, `nlp_create_qkv_heads` split each
# device's fused QKV output assuming `concat(q, k, v)`. A device that
# held two of the 8 KV groups had
# `concat(q_1, k_1, v_1, q_2, k_2, v_2)`: bad PCC. With one group per
# device the two orders are the same rows, and it worked. The package
# reads a rank's block of weight rows the same way (output column `j`
# of the projection is weight row `j`). The figure decodes what every
# rank holds, head by head, by running the loaders on a checkpoint
# whose rows carry their head's name:

# %%
fig = loaded_rows_figure(cfg)

# %% [markdown]
# ### The five measures
#
# Both bugs change the forward, so every measure after it fails; their
# correct twins (the same checkpoint, loaded right) pass:

# %%
runs = [tpattn.run(11, m, cfg) for m in
        ("qkv_loaded_from_rank0", "grouped_qkv_read_as_plain")]
runs += [check_injection(11, f"correct ({s})", Injection(shard=s), cfg)
         for s in ("fused", "grouped")]
print(measures_table(runs, compact=True))
assert [r["passed"] for r in runs] == [False, False, True, True]
assert all(r[m] > 10 * TOLERANCE for r in runs[:2] for m in MEASURES)

# %% [markdown]
# The tt-metal report's own observation: one group per rank reads the
# same either way. At `Hkv = W` the plain reading passes, which is why
# the mode needs `kv_heads >= 2 * world_size`:

# %%
one_group = Config()  # 2 KV heads on 2 ranks
r = check_injection(11, "read as plain", Injection(shard="grouped_as_plain"),
                    one_group)
assert r["passed"]
print("one group per rank, read as [Q; K; V]:",
      "PASSED" if r["passed"] else "FAILED")

# %% [markdown]
# ### What a live job shows
#
# A job can sum what each rank loaded and the slice of the checkpoint
# it should hold: `shard_checksums` is the difference per parameter and
# rank. The pattern of the differences names the loader: rank 0 right
# and every other rank off (one rank's rows everywhere); every rank's
# Q, K and V off while their sum is right (its own rows under the wrong
# names); rank 0's query rows right and its key/value rows off (a
# contiguous cut of `[Wq; Wk; Wv]`, `fused_qkv_naive_split`). The
# collectives are the plan's: the ledger shows nothing, and neither do
# the ranks' losses (g gives every rank the same wrong output).

# %%
patterns = ("qkv_rank0_only", "qkv_within_rank", "qkv_rank0_queries")
for mode in ("qkv_loaded_from_rank0", "grouped_qkv_read_as_plain",
             "fused_qkv_naive_split"):
    obs = observe(mode, 5, cfg, reference=False)  # tier 1
    shown = [p for p in patterns if features(obs)[p]]
    found = diagnose(obs)[0]
    print(f"{mode:26} {shown}  -> {found['cause']}")
    assert found["cause"] == mode and not found["tied_with"]
    assert len(shown) == 1 and features(obs)["shards_ok"]["wo"]
    assert obs["ledger"] == obs["planned_ledger"]
    assert features(obs)["losses_agree"]

# %% [markdown]
# ### Exercise 18.1: load your rank's rows
#
# Write `load(w, cfg, tp_rank)`: rank `tp_rank`'s `(wq, wk, wv)` from
# the full checkpoint `w` fused per KV group, as slices of `w` (so
# gradients reach it). The checker compares with the rank's heads on
# four shapes, one and several groups per rank.

# %%
def load(w, cfg, tp_rank):
    """[(Hq+2Hkv)*D, hidden] -> rank tp_rank's (wq, wk, wv)."""
    raise NotImplementedError

# %%
exercises.check_load_grouped_qkv(load)

# %% [markdown]
# A reference solution (in the book, click to show it), and the
# checker's verdict on it:

# %% tags=["hide-input", "exercise-solution"]
def load(w, cfg, tp_rank):
    """[(Hq+2Hkv)*D, hidden] -> rank tp_rank's (wq, wk, wv)."""
    n = w.shape[0] // cfg.world_size  # the rank's contiguous groups
    rows = w[tp_rank * n:(tp_rank + 1) * n]
    g, d = cfg.group_size, cfg.head_dim
    groups = rows.reshape(cfg.local_kv_heads, (g + 2) * d, -1)
    q, k, v = groups.split([g * d, d, d], dim=1)
    return tuple(t.reshape(-1, w.shape[1]) for t in (q, k, v))

# %%
exercises.check_load_grouped_qkv(load)

# %% [markdown]
# ### Exercise 18.2: which loader?
#
# Write `verdict(checksums, scale)`: from a run's `shard_checksums`
# (`{param: [one difference per rank]}`) and `shard_scale`
# (`{param: sum of |w|}`), return `"qkv_loaded_from_rank0"`,
# `"grouped_qkv_read_as_plain"`, `"fused_qkv_naive_split"`, or `None`
# when none of them fits (a correct load, or a bug of another kind).

# %%
def verdict(checksums, scale):
    """Name the loading bug from the shard checksums, or None."""
    raise NotImplementedError

# %%
exercises.check_loading_verdict(verdict)

# %% [markdown]
# A reference solution (in the book, click to show it), and the
# checker's verdict on it:

# %% tags=["hide-input", "exercise-solution"]
def verdict(checksums, scale):
    """Name the loading bug from the shard checksums, or None."""
    def ok(k, r):
        return abs(checksums[k][r]) <= 1e-5 * max(scale[k], 1.0)

    qkv, ranks = ("wq", "wk", "wv"), range(len(checksums["wq"]))
    if not all(ok("wo", r) for r in ranks):
        return None  # a whole shard moved: none of the three
    off = [not all(ok(k, r) for k in qkv) for r in ranks]
    if not any(off):
        return None
    if not off[0]:
        return "qkv_loaded_from_rank0"
    tol = 1e-5 * max(scale[k] for k in qkv)
    if all(abs(sum(checksums[k][r] for k in qkv)) <= tol for r in ranks):
        return "grouped_qkv_read_as_plain"
    if ok("wq", 0):
        return "fused_qkv_naive_split"
    return None

# %%
exercises.check_loading_verdict(verdict)
