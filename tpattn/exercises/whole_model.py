"""Part VI, the whole model (chapter 19): the vocabulary-parallel lookup's mask, the measures a
dropped LM-head f fails, and the loss offset of cross-entropy run on gathered logits."""
from __future__ import annotations

import functools
import math

import torch

from tpattn.bugs.lm_zoo import LM_REGISTRY
from tpattn.check.core import LR, MEASURES
from tpattn.check.lm import judge_lm
from tpattn.config import Config
from tpattn.exercises.graders import (EXTRA_SEEDS, Wrong, as_names, exercise, expect_shape,
                                      near, number, tensor)
from tpattn.model.config import LMConfig
from tpattn.model.job import dense_lm_job, lm_inputs, simulated_lm_job
from tpattn.model.tp import gather_lm_step
from tpattn.parallel.collectives import SimulatedRanks, VocabParallelCrossEntropy

WHOLE_MODEL_CHAPTER = 19
#: The LMs the checkers run: 2 ranks untied; 4 ranks (two per KV head), tied, vocabulary 40.
LM_CONFIGS = (LMConfig(), LMConfig(block=Config(world_size=4), vocab=40, tied=True))
#: The LM mode of the prediction exercise: the LM head's f dropped.
HEAD_F_MODE = "head_input_grad_reduce_missing"
#: The TP degrees the loss-offset exercise measures.
OFFSET_WORLD_SIZES = (2, 4, 8)


def lm_shape_text(lm: LMConfig) -> str:
    """An LM's shape in words: ranks, vocabulary, tied or not."""
    return f"{lm.block.world_size} ranks, vocabulary {lm.vocab}{', tied' if lm.tied else ''}"


# --- the vocabulary-parallel lookup -----------------------------------------------------------

def _first_wrong(got: torch.Tensor, tokens: torch.Tensor, full: torch.Tensor, rows: int,
                 rank: int, where: str) -> None:
    """``Wrong`` naming the first token where rank ``rank``'s partial ``got`` ``[S, B, hidden]``
    is not ``full``'s row (tokens in its ``rows``-row slice, checked first) or zero (others)."""
    first = rank * rows
    pairs = list(zip(tokens.reshape(-1).tolist(), got.detach().reshape(-1, full.shape[1])))
    for t, row in pairs:
        if first <= t < first + rows and not near(row, full[t], 2):
            raise Wrong(f"{where} rank {rank}'s partial at token id {t}, which it owns, is "
                        f"not its local row {t - first} (global row {t}): shift the ids by the "
                        f"slice's first row, rank·V/W = {first}, before the bounds check and "
                        f"the lookup.")
    for t, row in pairs:
        if not first <= t < first + rows and row.abs().max() > 0:
            clamped = (" (it is the slice's row 0, where the out-of-range id was clamped to "
                       "stay in bounds)" if near(row, full[first], 2) else "")
            raise Wrong(f"{where} rank {rank}'s partial is not zero at token id {t}, which "
                        f"rank {t // rows} owns{clamped}: zero the rows of tokens outside the "
                        f"slice, or g adds W−1 wrong rows to every token.")


@exercise("the vocabulary-parallel lookup", WHOLE_MODEL_CHAPTER)
def check_vocab_lookup(lookup) -> str:
    """Check ``lookup(tokens [S, B], embed_slice [V/W, hidden], rank) -> [S, B, hidden]``: the
    rank's rows of the tokens in its slice, zero elsewhere, its gradient reaching the slice."""
    count = 0
    for lm in LM_CONFIGS:
        w = lm.block.world_size
        for seed in EXTRA_SEEDS:
            params, tokens = lm_inputs(lm, seed)
            full, where = params["embed"], f"for seed {seed}, {lm_shape_text(lm)},"
            dy = torch.randn(*tokens.shape, full.shape[1],
                             generator=torch.Generator().manual_seed(seed))
            dense = torch.zeros_like(full).index_add_(0, tokens.reshape(-1),
                                                      dy.reshape(-1, full.shape[1]))
            for rank, chunk in enumerate(full.chunk(w)):
                mine = chunk.clone().requires_grad_(True)
                got = tensor(lookup(tokens.clone(), mine, rank), f"rank {rank}'s partial")
                expect_shape(got, [*tokens.shape, full.shape[1]], f"rank {rank}'s partial")
                _first_wrong(got, tokens, full, chunk.shape[0], rank, where)
                if got.requires_grad:
                    (got * dy).sum().backward()
                if mine.grad is None or not near(mine.grad, dense.chunk(w)[rank], tokens.numel()):
                    raise Wrong(f"{where} the partials are right but rank {rank}'s slice does "
                                f"not get the gradient of its rows: index embed_slice itself "
                                f"(no detach, no copy).")
                count += 1
    return (f"every rank's partial holds its own tokens' rows and zeros elsewhere, so g's sum "
            f"is the dense lookup, and each slice gets the gradient of its own rows: {count} "
            f"partials ({len(EXTRA_SEEDS)} seeds × {len(LM_CONFIGS)} LMs, 2 and 4 ranks).")


# --- the LM head's f dropped ------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def lm_mode_failures(mode: str) -> tuple[frozenset, ...]:
    """Per LM of ``LM_CONFIGS`` × ``EXTRA_SEEDS``: the measures ``mode`` fails under
    ``judge_lm``'s bounds (a measure above its bound fails)."""
    program = LM_REGISTRY[mode].program
    found = []
    for lm in LM_CONFIGS:
        for seed in EXTRA_SEEDS:
            judged = judge_lm(seed, mode, lm, dense_lm_job(lm, seed, LR),
                              gather_lm_step(simulated_lm_job(lm, seed, LR, program), lm), LR)
            found.append(frozenset(m for m in MEASURES if judged[m] > judged["bounds"][m]))
    return tuple(found)


@exercise("a dropped LM-head f", WHOLE_MODEL_CHAPTER)
def check_head_f_measures(predict) -> str:
    """Check ``predict() -> set``: the measures that fail when the LM head's f is dropped."""
    predicted = as_names(predict(), MEASURES, "measure")
    runs = lm_mode_failures(HEAD_F_MODE)
    always = runs[0]
    missed = [m for m in MEASURES if m in always - predicted]
    extra = [m for m in MEASURES if m in predicted - always]
    parts = []
    if missed:
        parts.append(f"you left out {', '.join(missed)}, which fail{'s' * (len(missed) == 1)} "
                     f"on every run: the final norm's dn keeps one rank's vocabulary slice")
    if extra:
        parts.append(f"you named {', '.join(extra)}, which pass{'es' * (len(extra) == 1)} on "
                     f"every run: f is the identity in the forward pass")
    if parts:
        raise Wrong(f"not quite: {'; '.join(parts)} ({len(runs)} runs: {len(EXTRA_SEEDS)} "
                    f"seeds × {len(LM_CONFIGS)} LMs).")
    return (f"right: on all {len(runs)} runs ({len(EXTRA_SEEDS)} seeds × {len(LM_CONFIGS)} LMs, "
            f"tied and untied) exactly the measures you named fail.")


# --- cross-entropy on gathered logits ---------------------------------------------------------

def gathered_loss_offset(world_size: int, seed: int = 0) -> float:
    """The mean of (loss of ``VocabParallelCrossEntropy`` fed every rank all ``V`` logits) −
    (its loss on the ranks' slices), on random logits ``[4, 3, 8·W]`` and targets."""
    g = torch.Generator().manual_seed(seed)
    v = 8 * world_size
    logits, target = torch.randn(4, 3, v, generator=g), torch.randint(v, (4, 3), generator=g)
    comm = SimulatedRanks(Config(world_size=world_size, query_heads=8, kv_heads=8))
    targets = target.expand(world_size, -1, -1)
    sliced = torch.stack(logits.chunk(world_size, dim=-1))
    right = VocabParallelCrossEntropy.apply(sliced, targets, comm)
    gathered = VocabParallelCrossEntropy.apply(logits.expand(world_size, -1, -1, -1), targets,
                                               comm)
    return float((gathered - right).mean())


@exercise("cross-entropy on gathered logits", WHOLE_MODEL_CHAPTER)
def check_gathered_ce_offset(offset) -> str:
    """Check ``offset(world_size) -> float``: how far above the correct loss the loss of
    vocabulary-parallel cross-entropy fed the gathered logits lies."""
    for w in OFFSET_WORLD_SIZES:
        measured = gathered_loss_offset(w)
        got = number(offset(w), (int, float), "your offset should be a number, but it is {}.")
        if abs(got - measured) <= 1e-4 * max(1.0, abs(measured)):
            continue
        if abs(got) < 1e-9:
            raise Wrong(f"at W = {w} the loss is not unchanged: it lies {measured:.3f} above "
                        f"the correct loss. Which all-reduce adds up W copies of one number?")
        if abs(got - math.log(2)) < 1e-6:
            raise Wrong(f"right at W = 2, but at W = {w} the offset is {measured:.3f}: it "
                        f"depends on how many ranks sum the exponentials.")
        raise Wrong(f"at W = {w} you said {got:.3f}, but the loss lies {measured:.3f} above "
                    f"the correct loss, at every token.")
    return (f"right: at W = {', '.join(map(str, OFFSET_WORLD_SIZES))} the loss on gathered "
            f"logits lies log W above the correct loss at every token (each rank adds all V "
            f"exponentials, the sum counts them W times); the target logit is still right.")
