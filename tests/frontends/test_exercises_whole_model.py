"""The checkers of chapter 19 (``tpattn.exercises.whole_model``) grade against what they claim:
every checked run of the dropped head f fails the same measures, the gathered-logits offset is
log W at every token, and a lookup right but for one token is named at that token."""
import math
import pathlib

import pytest
import torch

from tpattn.exercises import whole_model as wm


def test_every_run_of_the_dropped_head_f_fails_the_same_measures():
    runs = wm.lm_mode_failures(wm.HEAD_F_MODE)
    assert len(runs) == len(wm.LM_CONFIGS) * len(wm.EXTRA_SEEDS)
    assert len(set(runs)) == 1 and "forward_max_abs_diff" not in runs[0]


@pytest.mark.parametrize("world_size", wm.OFFSET_WORLD_SIZES)
def test_cross_entropy_on_gathered_logits_is_log_w_too_high(world_size):
    for seed in (0, 1):
        assert abs(wm.gathered_loss_offset(world_size, seed) - math.log(world_size)) < 1e-5


def test_a_lookup_wrong_at_one_token_is_named_at_that_token():
    def lookup(tokens, embed_slice, rank):
        rows = embed_slice.shape[0]
        local = tokens - rank * rows
        owned = (local >= 0) & (local < rows)
        out = torch.where(owned.unsqueeze(-1), embed_slice[torch.where(owned, local, 0)], 0.0)
        return out + (tokens == 3).unsqueeze(-1) * 1.0  # token id 3 gets a wrong row everywhere

    result = wm.check_vocab_lookup(lookup)
    assert not result.passed
    assert "token id 3" in result.message, result.message


def test_no_solution_of_chapter_19_lives_in_the_package():
    source = "".join(p.read_text() for p in pathlib.Path(wm.__file__).parent.glob("*.py"))
    assert "def lookup(" not in source and "def offset(" not in source
    assert "def check_vocab_lookup(" in source
