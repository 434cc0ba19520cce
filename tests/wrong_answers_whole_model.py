"""Known-wrong answers to the exercises of chapter 19, the whole model, each with the message
it must get (``tests/frontends/test_exercises.py`` runs them with the others)."""
from __future__ import annotations

import math

import torch


def lookup_unmasked(tokens, embed_slice, rank):  # embed_mask_forgotten: row 0 kept
    v = embed_slice.shape[0]
    local = tokens - rank * v
    owned = (local >= 0) & (local < v)
    return embed_slice[torch.where(owned, local, 0)]


def lookup_unshifted(tokens, embed_slice, rank):  # the ids never shifted by rank·V/W
    v = embed_slice.shape[0]
    owned = (tokens >= 0) & (tokens < v)
    rows = embed_slice[torch.where(owned, tokens, 0)]
    return torch.where(owned.unsqueeze(-1), rows, 0.0)


def lookup_detached(tokens, embed_slice, rank):  # the right rows, cut off from the slice
    v = embed_slice.shape[0]
    local = tokens - rank * v
    owned = (local >= 0) & (local < v)
    rows = embed_slice.detach()[torch.where(owned, local, 0)]
    return torch.where(owned.unsqueeze(-1), rows, 0.0)


GRADS = {"input_grad_max_abs_diff", "parameter_grad_max_abs_diff",
         "post_step_weight_max_abs_diff"}

WRONG_WHOLE_MODEL = [
    ("check_vocab_lookup", lookup_unmasked, "it is the slice's row 0"),
    ("check_vocab_lookup", lookup_unshifted, "shift the ids by the slice's first row"),
    ("check_vocab_lookup", lookup_detached, "does not get the gradient of its rows"),
    ("check_vocab_lookup", lambda tokens, embed_slice, rank: embed_slice[:2],
     "rank 0's partial has shape"),
    ("check_head_f_measures", lambda: GRADS | {"forward_max_abs_diff", "loss_abs_diff"},
     "you named forward_max_abs_diff, loss_abs_diff, which pass on every run"),
    ("check_head_f_measures", lambda: {"parameter_grad_max_abs_diff"},
     "you left out input_grad_max_abs_diff, post_step_weight_max_abs_diff"),
    ("check_head_f_measures", lambda: "input_grad_max_abs_diff", "should be a set of measure"),
    ("check_gathered_ce_offset", lambda w: 0.0, "at W = 2 the loss is not unchanged"),
    ("check_gathered_ce_offset", lambda w: math.log(2), "right at W = 2, but at W = 4"),
    ("check_gathered_ce_offset", lambda w: float(w), "at W = 2 you said 2.000"),
]
