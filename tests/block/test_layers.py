"""Each layer function against an independent reference (PyTorch's own modules, or math)."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tpattn import apply_rope, attention, repeat_kv, rms_norm
from tpattn.block.layers import attention_probs, rope_angles

DTYPES = [torch.float32, torch.float64]
# float32 results of two different op orders agree to a few ulps of values O(1): 1e-6 is
# ~8 ulps at 1.0; float64 to 1e-12.
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}


@pytest.mark.parametrize("dtype", DTYPES)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       hidden=st.integers(1, 32), eps=st.sampled_from([1e-6, 1e-5, 0.1]), seed=st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_rms_norm_matches_torch_rmsnorm(dtype, shape, hidden, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, hidden, generator=g, dtype=dtype)
    weight = torch.randn(hidden, generator=g, dtype=dtype)
    ref = torch.nn.RMSNorm(hidden, eps=eps, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(weight)
    torch.testing.assert_close(rms_norm(x, weight, eps), ref(x), **TOL[dtype])


def sdpa_reference(q, k, v):
    """PyTorch's fused attention on our [S, B, H, D] layout (it wants [B, H, S, D])."""
    to_bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
    out = F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v),
                                         is_causal=True, enable_gqa=True)
    return out.permute(2, 0, 1, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@given(seq=st.integers(1, 9), batch=st.integers(1, 3), kv_heads=st.integers(1, 3),
       groups=st.integers(1, 4), head_dim=st.sampled_from([2, 4, 8, 16]), seed=st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_gqa_attention_matches_sdpa(dtype, seq, batch, kv_heads, groups, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, batch, kv_heads * groups, head_dim, generator=g, dtype=dtype)
    k = torch.randn(seq, batch, kv_heads, head_dim, generator=g, dtype=dtype)
    v = torch.randn(seq, batch, kv_heads, head_dim, generator=g, dtype=dtype)
    ours = attention(q, repeat_kv(k, groups), repeat_kv(v, groups))
    torch.testing.assert_close(ours, sdpa_reference(q, k, v), **TOL[dtype])


def test_repeat_kv_maps_query_head_to_kv_head_h_div_groups():
    k = torch.arange(3.0).view(1, 1, 3, 1)  # KV head i holds the value i
    assert repeat_kv(k, 2).flatten().tolist() == [0, 0, 1, 1, 2, 2]


def test_attention_probs_are_causal_rows_summing_to_one():
    q, k = torch.randn(6, 2, 3, 4, dtype=torch.float64), torch.randn(6, 2, 3, 4, dtype=torch.float64)
    p = attention_probs(q, k)
    assert p.shape == (2, 3, 6, 6)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 3, 6, dtype=torch.float64))
    assert torch.all(p.triu(diagonal=1) == 0)


# --- RoPE: properties of a rotation, checked in float64 ----------------------------------

def pairs(x):
    """The rotate-half pairs (x[i], x[i + D/2]) as a trailing dim of 2."""
    half = x.shape[-1] // 2
    return torch.stack([x[..., :half], x[..., half:]], dim=-1)


@given(seq=st.integers(1, 12), head_dim=st.sampled_from([2, 4, 6, 8, 16, 64]), seed=st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_rope_preserves_the_norm_of_every_pair(seq, head_dim, seed):
    x = torch.randn(seq, 2, 3, head_dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    torch.testing.assert_close(pairs(apply_rope(x)).norm(dim=-1), pairs(x).norm(dim=-1),
                               rtol=1e-12, atol=1e-12)


@given(head_dim=st.sampled_from([2, 4, 8, 16, 64]), seed=st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_rope_position_zero_is_identity(head_dim, seed):
    x = torch.randn(4, 2, 3, head_dim, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(apply_rope(x)[0], x[0])  # cos 0 = 1, sin 0 = 0 exactly


@given(head_dim=st.sampled_from([2, 4, 8, 16]), seed=st.integers(0, 2**31))
@settings(max_examples=20, deadline=None)
def test_rope_dot_product_depends_only_on_relative_position(head_dim, seed):
    """<RoPE(q)_m, RoPE(k)_n> is the same for every (m, n) with the same m - n."""
    seq = 12
    g = torch.Generator().manual_seed(seed)
    q1 = torch.randn(head_dim, generator=g, dtype=torch.float64)
    k1 = torch.randn(head_dim, generator=g, dtype=torch.float64)
    # the same q and k vectors placed at every position
    rq = apply_rope(q1.expand(seq, 1, 1, head_dim).clone())[:, 0, 0]
    rk = apply_rope(k1.expand(seq, 1, 1, head_dim).clone())[:, 0, 0]
    dots = rq @ rk.T  # dots[m, n]
    for offset in range(-(seq - 1), seq):
        diag = torch.diagonal(dots, offset=-offset)  # entries with m - n == offset
        torch.testing.assert_close(diag, diag[0].expand_as(diag), rtol=1e-10, atol=1e-10)
    # and it does depend on the offset (else the property would hold vacuously)
    assert not torch.allclose(torch.diagonal(dots, 0)[0], torch.diagonal(dots, -1)[0])


def test_rope_angles_follow_the_roformer_schedule():
    theta = rope_angles(seq=3, head_dim=8, dtype=torch.float64)
    expected = [[m / 10000 ** (i / 4) for i in range(4)] for m in range(3)]
    torch.testing.assert_close(theta.view(3, 4), torch.tensor(expected, dtype=torch.float64))
    assert math.isclose(theta[2, 0, 0, 0].item(), 2.0)
