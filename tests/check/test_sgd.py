"""sgd.sgd_step: the seed's update bit for bit in float32/float64, float32 master weights for
bfloat16; and the bfloat16 weights-after-step measure that master weights make sighted."""
import pytest
import torch

from tpattn.bugs.zoo import REGISTRY
import tpattn
from tpattn import Config
from tpattn.check.core import LR, PARAM_SEED_OFFSET, dense_reference, make_inputs, one_step
from tpattn.block.params import init_params
from tpattn.block.sgd import sgd_step
from tpattn.check.tolerance import UNIT_ROUNDOFF, parameter_bounds, ratios, relative_bound

WEIGHTS = "post_step_weight_max_abs_diff"


def _draw(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = {"w": torch.randn(8, 4, generator=g), "norm": torch.ones(4)}
    grads = {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in p.items()}
    return ({k: v.to(dtype) for k, v in p.items()}, {k: v.to(dtype) for k, v in grads.items()})


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_full_precision_update_is_the_seeds_bit_for_bit(dtype):
    p, g = _draw(dtype)
    out = sgd_step(p, g, LR)
    for k in p:
        assert out[k].dtype == dtype and torch.equal(out[k], p[k] - LR * g[k])
    half = sgd_step(p, g, LR, scale=0.5)
    assert all(torch.equal(half[k], p[k] - LR * 0.5 * g[k]) for k in p)


def test_bfloat16_updates_float32_master_weights():
    p, g = _draw(torch.bfloat16)
    out = sgd_step(p, g, LR)
    for k in p:
        assert out[k].dtype == torch.float32 and out[k].shape == p[k].shape
        assert torch.equal(out[k], p[k].float() - LR * g[k].float())
    # the pure-bfloat16 update rounds lr * g ~ 5e-5 away against norm's 1.0 (spacing 2**-7);
    # the master weights keep it
    pure = p["norm"] - LR * g["norm"]
    assert torch.equal(pure.float(), p["norm"].float())
    assert not torch.equal(out["norm"], p["norm"].float())


def test_bad_parameter_dtype_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"params\['w'\]\.dtype"):
        sgd_step({"w": torch.ones(2, dtype=torch.float16)}, {"w": torch.ones(2)}, LR)


SP = Config(seq=16, batch=1, hidden=512, query_heads=8, kv_heads=8, head_dim=64,
            world_size=2, dtype="bfloat16", sequence_parallel=True)
SP_BUGS = ("missing_norm_grad_reduce", "norm_grad_averaged", "missing_input_grad_reduce")


def _old_bf16_weights_ratio(cfg, seed, mode):
    """The measure as it was: both sides update in bfloat16, bound 2 u_bf16 |w'| + lr * one
    gradient bound over all parameters."""
    from tpattn.check.core import tp_step

    x0, target = make_inputs(cfg, seed)
    base = init_params(cfg, seed + PARAM_SEED_OFFSET, "fan_in")
    sides = [dense_reference(x0, target, base, cfg),
             tp_step(x0, target, base, cfg, REGISTRY[mode].injection)]
    old = [{k: (base[k] - LR * s["grads"][k]) for k in base} for s in sides]
    diff = max((old[0][k].float() - old[1][k].float()).abs().max().item() for k in base)
    u = UNIT_ROUNDOFF["bfloat16"]
    bound = (2 * u * max(w.float().abs().max().item() for w in old[0].values())
             + LR * relative_bound(cfg) * max(g.abs().max().item()
                                              for g in sides[0]["grads"].values()))
    return diff / bound


@pytest.mark.parametrize("seed", (1, 3))
def test_bfloat16_weights_measure_sees_the_sp_bugs_correct_tp_passes(seed):
    # Tuned on seed 1; seed 3 held out. fan_in init: the step is well conditioned, so every
    # verdict is pass or fail, and lr * g sits below bfloat16's spacing of the weights.
    ok = tpattn.run(seed, "equivalence", SP, tolerance="auto", init="fan_in")
    assert ok["verdict"] == "pass", ok
    assert ratios(ok, ok["bounds"])[WEIGHTS] < 1
    for mode in SP_BUGS:
        bug = tpattn.run(seed, mode, SP, tolerance="auto", init="fan_in")
        assert bug["verdict"] == "fail", bug
        assert ratios(bug, bug["bounds"])[WEIGHTS] > 3, (mode, bug)   # measured 8-21
        if mode != "missing_input_grad_reduce":
            assert _old_bf16_weights_ratio(SP, seed, mode) < 0.2   # measured 0.03: blind


def test_bfloat16_weights_measure_sees_plain_tp_missing_f():
    cfg = Config(seq=16, batch=1, hidden=512, query_heads=8, kv_heads=8, head_dim=64,
                 world_size=4, dtype="bfloat16")
    for seed in (2, 5):
        bug = tpattn.run(seed, "missing_input_grad_reduce", cfg, tolerance="auto",
                         init="fan_in")
        assert bug["verdict"] == "fail" and ratios(bug, bug["bounds"])[WEIGHTS] > 3, bug
        assert tpattn.run(seed, "equivalence", cfg, tolerance="auto",
                          init="fan_in")["verdict"] == "pass"


def test_weights_bound_is_float32s_update_plus_bfloat16s_gradient():
    cfg = Config(dtype="bfloat16")
    x0, target = make_inputs(cfg, 11)
    base = init_params(cfg, 11 + PARAM_SEED_OFFSET)
    dense = dense_reference(x0, target, base, cfg)
    assert all(w.dtype == torch.float32 for w in dense["weights"].values())
    pb = parameter_bounds(cfg, dense, LR)
    u32, rho = UNIT_ROUNDOFF["float32"], relative_bound(cfg)
    for k, g in dense["grads"].items():
        w, gm = dense["weights"][k].abs().max().item(), g.abs().max().item()
        assert pb[WEIGHTS][k] == pytest.approx(2 * u32 * (w + LR * gm) + LR * rho * gm)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16))
def test_an_in_place_step_on_master_weights_is_sgd_step(dtype):
    from tpattn.block.sgd import master_weights, sgd_step_in_place

    g = torch.Generator().manual_seed(3)
    params = {k: torch.randn(4, 3, generator=g).to(dtype) for k in ("wq", "norm")}
    grads = {k: torch.randn(4, 3, generator=g).to(dtype) for k in params}
    before = {k: p.clone() for k, p in params.items()}
    masters = sgd_step_in_place(params, grads, 0.1)
    expected = sgd_step(before, grads, 0.1)
    for k in params:
        assert torch.equal(masters[k], expected[k]) and masters[k].dtype == expected[k].dtype
        # float32/float64 step the parameter itself; bfloat16 steps a float32 copy
        assert torch.equal(params[k], masters[k] if dtype != torch.bfloat16 else before[k])
    with pytest.raises(ValueError, match=r"params\['x'\]\.dtype must be one of"):
        master_weights({"x": torch.zeros(2, dtype=torch.float16)})
