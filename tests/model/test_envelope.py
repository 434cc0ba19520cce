"""Rounding or a bug, at step N: correct TP judged "rounding" on shapes and seeds the envelope was
not tuned on (bench/lm_envelope.py's held-out cases, fewer steps), f dropped before the MLP
judged a bug from step 1, ``verdict``'s logic on made-up curves, and bad arguments."""
from dataclasses import replace

import pytest
import torch

from tpattn.config import Config
from tpattn.model.config import LMConfig
from tpattn.model.envelope import (assess, dense_step_fn, divergence, rounding_envelope, tp_step_fn,
                                   train_curve, verdict)
from tpattn.model.params import init_lm_params
from tpattn.model.tp import LM_CORRECT

LR = 0.1
#: bench/lm_envelope.py's MARGIN (chosen on its TUNE cases; correct TP reached 1.85 there).
MARGIN = 4.0
#: bench/lm_envelope.py's HELD_OUT shapes and seeds.
HELD_OUT = {
    101: ({"vocab": 48, "layers": 3, "ffn": 40},
          {"hidden": 24, "query_heads": 4, "kv_heads": 2, "head_dim": 6, "seq": 6, "batch": 3}),
    202: ({"vocab": 64, "layers": 1, "ffn": 64, "tied": True},
          {"hidden": 32, "query_heads": 8, "kv_heads": 4, "head_dim": 4, "seq": 4, "batch": 2}),
}


def keep(t, comm, label=None):
    """A dropped collective: ``t`` as it is, forward and backward."""
    return t


def judged(seed: int, world_size: int, dtype: str, steps: int, prog=LM_CORRECT) -> str:
    """The verdict on TP ``prog`` after ``steps`` steps of held-out case ``seed``."""
    shape, block = HELD_OUT[seed]
    lm = LMConfig(block=Config(world_size=world_size, dtype=dtype, **block), **shape)
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(lm.vocab, (lm.block.seq, lm.block.batch), generator=g)
               for _ in range(steps)]
    params = init_lm_params(lm, seed)
    dense = train_curve(dense_step_fn(lm), params, batches, LR)
    envelope = rounding_envelope(dense_step_fn(lm), dense_step_fn(lm, "float64"), params,
                                 batches, LR, dense, k=2, seed=seed)
    return verdict(dense, train_curve(tp_step_fn(lm, prog), params, batches, LR), envelope,
                   MARGIN)


@pytest.mark.parametrize("seed, world_size, dtype", [(101, 2, "float32"), (202, 4, "bfloat16")])
def test_correct_tp_is_judged_rounding_on_held_out_cases(seed, world_size, dtype):
    assert judged(seed, world_size, dtype, steps=12) == "rounding"


def test_f_missing_before_the_mlp_is_a_bug_from_the_first_step():
    assert judged(202, 2, "float32", steps=4, prog=replace(LM_CORRECT, mlp_f=keep)) \
        == "bug from step 1"


def curve(weights: list[float], start: float = 1.0) -> dict:
    """A made-up curve: one weight per step ``[N, 1]``, loss 1 each step."""
    return {"losses": torch.ones(len(weights), dtype=torch.float64),
            "weights": torch.tensor(weights, dtype=torch.float64).unsqueeze(1),
            "start": torch.tensor([start], dtype=torch.float64)}


def test_verdict_names_the_first_step_outside_and_counts_nan_as_outside():
    dense = curve([2.0, 3.0, 4.0, 5.0])
    envelope = torch.full((4,), 1e-3, dtype=torch.float64)
    run = curve([2.0, 3.0 * (1 + 3e-3), 4.0 * (1 + 5e-3), 5.0])
    assert divergence(run, dense)["weights"][1] == pytest.approx(3e-3)
    assert verdict(dense, run, envelope, 4.0) == "bug from step 3"
    assert verdict(dense, run, envelope, 2.0) == "bug from step 2"
    assert verdict(dense, curve([2.0, 3.0, float("nan"), 5.0]), envelope, 4.0) \
        == "bug from step 3"
    assert verdict(dense, dense, envelope, 4.0) == "rounding"


def test_verdict_is_inconclusive_once_the_envelope_reaches_the_drift():
    dense = curve([1.01, 1.02, 1.03])  # drift 0.01, 0.02, 0.03
    envelope = torch.tensor([1e-4, 1e-3, 1e-2], dtype=torch.float64)
    late_bug = curve([1.01, 1.02, 1.2])
    result = verdict(dense, late_bug, envelope, 4.0)
    assert result.startswith("rounding through step 2, inconclusive after (from step 3"), result
    judged_late = assess(dense, late_bug, envelope, 4.0)
    assert (judged_late["kind"], judged_late["left"], judged_late["through"]) == \
        ("inconclusive", None, 2)
    assert verdict(dense, dense, torch.zeros(3, dtype=torch.float64), 4.0) \
        .startswith("inconclusive (the envelope is zero")


def test_bad_arguments_raise_value_errors_naming_the_field():
    dense = curve([2.0, 3.0])
    with pytest.raises(ValueError, match="margin must be >= 1"):
        verdict(dense, dense, torch.ones(2, dtype=torch.float64), 0.5)
    with pytest.raises(ValueError, match="envelope must have one value per step"):
        verdict(dense, dense, torch.ones(3, dtype=torch.float64), 4.0)
    with pytest.raises(ValueError, match="same number of steps"):
        divergence(curve([2.0]), dense)
    lm = LMConfig(block=Config(world_size=2))
    params = init_lm_params(lm, 1)
    with pytest.raises(ValueError, match="batches must hold at least one"):
        train_curve(dense_step_fn(lm), params, [], LR)
    with pytest.raises(ValueError, match="lr must be > 0"):
        train_curve(dense_step_fn(lm), params, [torch.zeros(5, 2, dtype=torch.long)], 0.0)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        rounding_envelope(dense_step_fn(lm), dense_step_fn(lm, "float64"), params, [], LR,
                          dense, k=0)


def test_clipping_scales_the_gradients_as_the_step_scales_the_update():
    from tpattn.model.envelope import clip_scale
    lm = LMConfig(block=Config(world_size=2))
    params, tokens = init_lm_params(lm, 1), torch.randint(lm.vocab, (5, 2))
    _, plain = dense_step_fn(lm)(params, tokens)
    _, clipped = dense_step_fn(lm, clip=True)(params, tokens)
    norm = float(sum(g.double().pow(2).sum() for g in plain.values()) ** 0.5)
    scale = clip_scale(norm, True)
    assert scale < 1  # the LM's gradient norm is above MAX_GRAD_NORM here
    assert all(torch.allclose(clipped[k], plain[k] * scale) for k in plain)
    _, tp_clipped = tp_step_fn(lm, replace(LM_CORRECT, clip=True))(params, tokens)
    assert all(torch.allclose(tp_clipped[k], clipped[k], atol=1e-6) for k in plain)
    assert clip_scale(norm, False) == 1.0


def test_assess_gives_the_kind_the_step_left_and_the_last_rounding_step():
    dense = curve([2.0, 3.0, 4.0])
    envelope = torch.full((3,), 1e-3, dtype=torch.float64)
    bug = assess(dense, curve([2.0, 3.0 * 1.01, 4.0]), envelope, 4.0)
    assert (bug["kind"], bug["left"], bug["through"]) == ("bug", 2, None)
    same = assess(dense, dense, envelope, 4.0)
    assert (same["kind"], same["left"], same["through"]) == ("rounding", None, 3)


def test_a_float32_replay_names_a_bug_its_bfloat16_envelope_hides():
    from tpattn.model.envelope import replayed
    inside = {"kind": "inconclusive", "left": None, "through": 16,
              "text": "rounding through step 16, inconclusive after (reason)"}
    caught = replayed(inside, {"kind": "bug", "left": 2, "through": None,
                               "text": "bug from step 2"})
    assert (caught["kind"], caught["left"], caught["through"]) == ("bug", 2, None)
    assert caught["text"] == ("bug from step 2 in the float32 replay (inside its own envelope: "
                              "rounding through step 16, inconclusive after)")
    kept = replayed(inside, {"kind": "rounding", "left": None, "through": 20,
                             "text": "rounding"})
    assert kept["text"] == inside["text"] and kept["replay"] == "rounding"
