"""tpattn.interop: the book's block is HF's Llama attention; checkpoint layouts both ways."""
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from tpattn import Config, dense_forward  # noqa: E402
from tpattn.interop import (  # noqa: E402
    LlamaAttentionBlock, adjacent_from_rotate_half, apply_rope_adjacent, concat_qkv,
    config_from_llama, float32_tolerance, fuse_qkv, llama_config, llama_layer, llama_params,
    llama_tp_plan, load_llama_params, meta_dense_forward, read_rank_slices,
    rotate_half_from_adjacent, split_fused_qkv)
from tpattn.block.layers import apply_rope  # noqa: E402

#: (query_heads, kv_heads, head_dim, hidden): GQA 2:1, MHA, GQA 4:1, MQA-like with 1 KV head.
SHAPES = [(4, 2, 4, 16), (4, 4, 4, 16), (8, 2, 8, 32), (4, 1, 6, 24)]
DTYPES = ["float32", "float64"]
#: float64 rounding at these sizes (a few hundred float64 operations, values of order 1)
F64_ROUNDING = 1e-12


def make_cfg(shape, dtype, world_size=1, seq=6, batch=2):
    hq, hkv, d, hidden = shape
    return Config(seq=seq, batch=batch, hidden=hidden, query_heads=hq, kv_heads=hkv,
                  head_dim=d, world_size=world_size, dtype=dtype)


def inputs(cfg, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g).to(cfg.torch_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dense_forward_is_hf_llama_attention_within_float32_rounding(shape, dtype):
    cfg = make_cfg(shape, dtype)
    layer = llama_layer(cfg, seed=7)
    got_cfg, params = llama_params(layer, seq=cfg.seq, batch=cfg.batch)
    assert got_cfg == cfg
    x = inputs(cfg)
    with torch.no_grad():
        hf = LlamaAttentionBlock(layer)(x)
        ours = dense_forward(x, params, cfg)
    assert hf.dtype == ours.dtype == cfg.torch_dtype
    err = (hf - ours).abs().max().item()
    assert err < float32_tolerance(cfg, hf.abs().max().item())
    # the bound is far below what a wrong block gives (O(0.1), see the RoPE tests below)
    assert float32_tolerance(cfg, hf.abs().max().item()) < 1e-3


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_hf_block_is_causal_with_every_attention_implementation(implementation):
    cfg = make_cfg(SHAPES[0], "float32")
    block = LlamaAttentionBlock(llama_layer(cfg, seed=7, attn_implementation=implementation))
    _, params = llama_params(block.layer, seq=cfg.seq, batch=cfg.batch)
    x = inputs(cfg)
    with torch.no_grad():
        err = (block(x) - dense_forward(x, params, cfg)).abs().max().item()
        # changing the last token changes no earlier position's output
        later = x.clone()
        later[-1] += 1.0
        early = (block(later)[:-1] - block(x)[:-1]).abs().max().item()
    assert err < float32_tolerance(cfg, 10.0) and early == 0.0


def test_llama_layer_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    llama_layer(make_cfg(SHAPES[0], "float32"))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_float64_hf_is_float32_inside_and_so_not_float64_exact():
    """HF normalizes in float32 even for a float64 model: its RMSNorm is, bit for bit, the
    float32 RMSNorm cast up; so the float64 block differs from ours by float32 rounding."""
    cfg = make_cfg(SHAPES[0], "float64")
    layer = llama_layer(cfg, seed=7)
    x = inputs(cfg)
    with torch.no_grad():
        hf_norm = layer.input_layernorm(x)
        float32_norm = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)
                                                + cfg.eps)).double() * layer.input_layernorm.weight
        assert torch.equal(hf_norm, float32_norm)
        _, params = llama_params(layer, seq=cfg.seq, batch=cfg.batch)
        err = (LlamaAttentionBlock(layer)(x) - dense_forward(x, params, cfg)).abs().max().item()
    assert F64_ROUNDING < err < float32_tolerance(cfg, 10.0)


def test_params_round_trip_through_the_hf_layer_exactly():
    cfg = make_cfg(SHAPES[2], "float32")
    layer = llama_layer(cfg, seed=1)
    _, params = llama_params(layer, seq=cfg.seq, batch=cfg.batch)
    other = {k: torch.randn_like(v) for k, v in params.items()}
    _, back = llama_params(load_llama_params(layer, other), seq=cfg.seq, batch=cfg.batch)
    assert all(torch.equal(back[k], other[k]) for k in other)
    assert llama_config(cfg).base_model_tp_plan  # HF declares a TP plan for Llama


def test_bad_layer_or_params_raise_value_error_naming_the_field():
    cfg = make_cfg(SHAPES[0], "float32")
    hf = llama_config(cfg)
    hf.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    with pytest.raises(ValueError, match="rope_parameters must be the default RoPE"):
        config_from_llama(hf, seq=4, batch=1)
    hf = llama_config(cfg)
    hf.attention_bias = True
    with pytest.raises(ValueError, match="attention_bias must be False"):
        config_from_llama(hf, seq=4, batch=1)
    layer = llama_layer(cfg)
    _, params = llama_params(layer, seq=4, batch=1)
    params["wk"] = params["wk"][:4]
    with pytest.raises(ValueError, match=r"params\['wk'\] must have the shape"):
        load_llama_params(layer, params)


def test_hf_tp_plan_is_colwise_qkv_rowwise_o():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = llama_tp_plan()
    assert set(plan) == {f"layer.self_attn.{n}_proj" for n in "qkvo"}
    assert all(isinstance(plan[f"layer.self_attn.{n}_proj"], ColwiseParallel) for n in "qkv")
    assert isinstance(plan["layer.self_attn.o_proj"], RowwiseParallel)


# --- RoPE pairing -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_rope_permutation_round_trips_exactly_and_is_a_row_permutation(shape, dtype):
    cfg = make_cfg(shape, dtype)
    _, params = llama_params(llama_layer(cfg, seed=2), seq=cfg.seq, batch=cfg.batch)
    for name, heads in (("wq", cfg.query_heads), ("wk", cfg.kv_heads)):
        w = params[name]
        meta = adjacent_from_rotate_half(w, heads)
        assert not torch.equal(meta, w)
        assert torch.equal(rotate_half_from_adjacent(meta, heads), w)
        assert torch.equal(adjacent_from_rotate_half(rotate_half_from_adjacent(w, heads), heads), w)
        assert torch.equal(meta.sort(0).values, w.sort(0).values)  # same rows, reordered


def test_adjacent_rope_is_rotate_half_on_permuted_channels():
    """Meta's pairing and HF's rotate the same pairs once the channels are permuted."""
    cfg = make_cfg(SHAPES[0], "float64")
    x = torch.randn(cfg.seq, 2, 3, 8, dtype=torch.float64)
    perm = rotate_half_from_adjacent(torch.arange(8.0).view(8, 1), 1).view(-1).long()
    got = apply_rope_adjacent(x)[..., perm]
    assert (got - apply_rope(x[..., perm])).abs().max().item() < F64_ROUNDING


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_meta_checkpoint_needs_the_permutation(shape, dtype):
    """Same attention after the permutation; garbage without it (in HF's own layer too)."""
    cfg = make_cfg(shape, dtype)
    layer = llama_layer(cfg, seed=3)
    _, hf_params = llama_params(layer, seq=cfg.seq, batch=cfg.batch)
    meta = dict(hf_params, wq=adjacent_from_rotate_half(hf_params["wq"], cfg.query_heads),
                wk=adjacent_from_rotate_half(hf_params["wk"], cfg.kv_heads))
    x = inputs(cfg)
    with torch.no_grad():
        reference = meta_dense_forward(x, meta, cfg)
        converted = dense_forward(x, hf_params, cfg)
        unconverted = dense_forward(x, meta, cfg)
        hf_unconverted = LlamaAttentionBlock(load_llama_params(layer, meta))(x)
    bound = 1e-6 if dtype == "float32" else F64_ROUNDING  # same arithmetic up to rounding
    assert (converted - reference).abs().max().item() < bound
    assert (unconverted - reference).abs().max().item() > 1e-2
    assert (hf_unconverted - reference).abs().max().item() > 1e-2


# --- fused QKV --------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_qkv_round_trips_exactly_both_layouts(shape, world_size):
    cfg = make_cfg(shape, "float32", world_size=1 if shape[1] % world_size else world_size)
    _, p = llama_params(llama_layer(cfg, seed=4), seq=cfg.seq, batch=cfg.batch)
    qkv = (p["wq"], p["wk"], p["wv"])
    fused = fuse_qkv(*qkv, cfg)
    assert fused.shape == ((cfg.query_heads + 2 * cfg.kv_heads) * cfg.head_dim, cfg.hidden)
    assert all(torch.equal(a, b) for a, b in zip(split_fused_qkv(fused, cfg), qkv))
    concat = concat_qkv(*qkv, cfg)
    assert all(torch.equal(a, b) for a, b in zip(split_fused_qkv(concat, cfg, "concatenated"), qkv))
    assert torch.equal(fuse_qkv(*split_fused_qkv(fused, cfg), cfg), fused)
    # contiguous rank slices of the interleaved weight are complete groups
    assert all(torch.equal(a, b) for a, b in zip(read_rank_slices(fused, cfg), qkv))


def test_naive_concatenation_hands_rank_0_only_query_rows():
    cfg = Config()  # 4 query heads, 2 KV heads, 2 ranks
    p = llama_params(llama_layer(cfg, seed=4), seq=cfg.seq, batch=cfg.batch)[1]
    wq, wk, wv = read_rank_slices(concat_qkv(p["wq"], p["wk"], p["wv"], cfg), cfg)
    d = cfg.head_dim
    # rank 0 reads query heads 2 and 3 as its key and value head
    assert torch.equal(wk[:d], p["wq"][2 * d:3 * d]) and torch.equal(wv[:d], p["wq"][3 * d:4 * d])
    with pytest.raises(ValueError, match="layout must be one of"):
        split_fused_qkv(concat_qkv(p["wq"], p["wk"], p["wv"], cfg), cfg, "megatron")
    with pytest.raises(ValueError, match="wk must be"):
        fuse_qkv(p["wq"], p["wk"][:4], p["wv"], cfg)


def test_naive_split_signature_every_measure_wrong_unlike_a_missing_reduction():
    """Loading the naive split is another block: the forward is off by O(1), like a missing g,
    but unlike the missing reductions, the ranks' weights differ from dense before any step."""
    cfg = Config()
    x = inputs(cfg)
    _, p = llama_params(llama_layer(cfg, seed=4), seq=cfg.seq, batch=cfg.batch)
    wq, wk, wv = read_rank_slices(concat_qkv(p["wq"], p["wk"], p["wv"], cfg), cfg)
    loaded = dict(p, wq=wq, wk=wk, wv=wv)
    forward_diff = (dense_forward(x, loaded, cfg) - dense_forward(x, p, cfg)).abs().max().item()
    assert forward_diff > 1e-2
    assert max((loaded[k] - p[k]).abs().max().item() for k in p) > 1e-2


def test_import_tpattn_does_not_import_transformers():
    code = ("import sys, tpattn, tpattn.real.module_check; tpattn.check_module; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
