"""magnitude.backward_magnitudes bounds every backward it stands for, entry by entry.

``M`` is the backward from ``u`` with every factor in absolute value, so it is at least
``|J|^T u`` for the whole Jacobian ``J`` of the parameter gradients with respect to ``dL/dy``
(each entry of ``J`` is a sum of the products ``M`` adds up in absolute value). The test
builds ``J`` column by column with autograd (float64) and checks ``|J|^T u <= M``: a missing
term or a wrong absolute-value rule (e.g. RoPE's ``|cos| + |sin|``) puts some entry below
it; for ``wo``, whose gradient is a single sum of products, the two are equal.
"""
import torch
from hypothesis import given, settings, strategies as st

from tpattn import Config
from tpattn.block.dense import dense_forward
from tpattn.block.params import init_params
from tpattn.check.core import PARAM_SEED_OFFSET, dense_reference, make_inputs
from tpattn.check.magnitude import backward_magnitudes, gradient_magnitudes
from tests.strategies import valid_configs


def _backward(x0, base, cfg, e):
    p = {k: v.double().requires_grad_(True) for k, v in base.items()}
    y = dense_forward(x0.double(), p, cfg)
    return dict(zip(p, torch.autograd.grad(y, list(p.values()), grad_outputs=e)))


@given(cfg=valid_configs(dtypes=("float64",), max_seq=4, max_hidden=12),
       seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_every_backward_within_the_upstream_is_within_the_magnitudes(cfg, seed):
    x0, _ = make_inputs(cfg, seed)
    base = init_params(cfg, seed + PARAM_SEED_OFFSET)
    upstream = torch.rand(x0.shape, generator=torch.Generator().manual_seed(seed),
                          dtype=torch.float64)
    m = backward_magnitudes(x0, base, cfg, upstream)
    jtu = {k: torch.zeros_like(v) for k, v in m.items()}  # |J|^T u, one column at a time
    for i in range(upstream.numel()):
        e = torch.zeros(upstream.numel(), dtype=torch.float64)
        e[i] = 1.0
        for k, col in _backward(x0, base, cfg, e.view(x0.shape)).items():
            jtu[k] += col.abs() * upstream.flatten()[i]
    for k in m:
        assert (jtu[k] <= m[k] * (1 + 1e-9) + 1e-300).all(), k
    # wo's gradient dy^T ctx is one sum of products: nothing to cancel, so M is |J|^T u
    torch.testing.assert_close(m["wo"], jtu["wo"], rtol=1e-12, atol=0)


def test_the_loss_gradients_are_within_their_magnitudes_and_wk_cancels_at_hidden_1():
    for cfg, seed in ((Config(dtype="float64"), 11),
                      (Config(seq=2, batch=2, hidden=1, query_heads=8, kv_heads=4,
                              head_dim=6, world_size=2, dtype="float64"), 860)):
        x0, target = make_inputs(cfg, seed)
        base = init_params(cfg, seed + PARAM_SEED_OFFSET)
        grads = dense_reference(x0, target, base, cfg)["grads"]
        m = gradient_magnitudes(x0, target, base, cfg)
        assert all((grads[k].abs() <= m[k] * (1 + 1e-12)).all() for k in grads)
    # hidden 1: every normalized token is +-norm, so wk's gradient is a cancellation
    assert grads["wk"].abs().max() < 1e-5 * m["wk"].max()
