"""Exercises that check themselves: the reader writes the code, the package says what is right.

Each ``check_*`` function takes the reader's function, runs it through the package — the five
measures of ``tpattn.check.core`` against the dense block, the collective ledger where it applies —
on several seeds and shapes (more than the chapter tried: ``CHECKED_SEEDS`` × ``CHECKED_CONFIGS``)
and returns a ``Result``: ``.passed`` and one short paragraph saying what is right, what is
wrong and which chapter explains it. A checker never shows a traceback: an exception in the
reader's code becomes one sentence naming the line and the error, and a stub that still raises
``NotImplementedError`` is reported as not written yet. No solution lives here: the reference
solutions are cells of the chapters' notebooks (tagged ``hide-input``).

``import tpattn`` does not import this module; a notebook imports it where its exercises begin.
"""
from __future__ import annotations

import functools
import html
import os
import random
import sysconfig
import textwrap
import traceback
from dataclasses import dataclass

import torch

from tpattn.check.core import (EQUIVALENCE, LR, MEASURES, MISSING_INPUT_GRAD_REDUCE, MISSING_OUTPUT_REDUCE,
                    MODES, PARAM_SEED_OFFSET, SIMULATIONS, TOLERANCE, dense_reference,
                    five_measures, make_inputs, max_abs_diff, tp_step)
from tpattn.bugs.modes import resolve, run
from tpattn.config import Config
from tpattn.block.dense import attend_and_project, dense_forward
from tpattn.block.layers import rms_norm
from tpattn.block.sgd import sgd_step
from tpattn.block.params import PARAM_NAMES, clone_trainable, init_params, rank_head_slices, shard_params
from tpattn.parallel.injection import Injection
from tpattn.parallel.simulated import (gather_steps, rank0_view, rank_steps,
                                 simulated_step)
from tpattn.parallel.tp import tp_forward

__all__ = [
    "Result", "CHECKED_SEEDS", "CHECKED_CONFIGS",
    "check_train_step", "check_five_measures",
    "check_shard_params", "check_keeps_groups",
    "check_g", "check_f",
    "check_missing_g_signature", "check_fingerprint",
    "check_missing_f_signature", "check_missing_f_parameters",
    "check_signature", "check_diagnose",
    "check_bytes_per_step", "check_ledger_counts", "check_real_f_and_g",
    "check_norm_grad_reduce", "check_rope_offset",
    "check_kv_grad_reduce", "check_missing_kv_parameters",
    "check_relative_bound", "check_classify",
    "check_shard_concat_qkv", "check_shard_fused_qkv",
    "check_bias_once", "check_forward_visible",
    "check_ledger_verdict", "check_hunts", "hunt_evidence",
]

#: Seeds the checkers of chapters 5-11 use: two of the fixture's and one the chapters never
#: show (the slower ones of chapters 12-18 use ``EXTRA_SEEDS``).
CHECKED_SEEDS = (11, 17, 5)
#: Shapes every checker uses: the fixture's; 8 query heads sharing 4 KV heads on 4 ranks; and
#: a small odd one (3 tokens, batch 1, hidden 8, 6 query heads in groups of 3, head_dim 2).
CHECKED_CONFIGS = (
    Config(),
    Config(query_heads=8, kv_heads=4, world_size=4),
    Config(seq=3, batch=1, hidden=8, query_heads=6, kv_heads=2, head_dim=2),
)
#: The chapters the messages point to.
CHAPTERS = {5: "chapter 5 (the dense block)", 6: "chapter 6 (head sharding)",
            7: "chapter 7 (the two reductions)", 8: "chapter 8 (the missing output reduce)",
            9: "chapter 9 (the missing input-gradient reduce)", 10: "chapter 10 (the matrix)",
            11: "chapter 11 (real ranks)", 12: "chapter 12 (sequence parallelism)",
            13: "chapter 13 (fewer KV heads than ranks)", 14: "chapter 14 (equal at scale)",
            15: "chapter 15 (your model)", 16: "chapter 16 (the bug zoo)",
            17: "chapter 17 (around the block)", 18: "chapter 18 (debugging without dense)"}
#: Width of the text paragraph (the book's code column).
WIDTH = 75


@dataclass(frozen=True)
class Result:
    """A checker's verdict: ``passed`` and ``message``, one short paragraph (shown as the
    cell's output: text in a terminal, HTML in a notebook)."""

    exercise: str
    passed: bool
    message: str

    def text(self) -> str:
        """The paragraph as one line of text, with a ✓ or ✗ in front."""
        head = "✓ " if self.passed else "✗ "
        return head + f"{self.exercise}: {self.message}"

    def __repr__(self) -> str:
        return textwrap.fill(self.text(), WIDTH)

    def _repr_html_(self) -> str:
        color = "#1a7f37" if self.passed else "#b35900"
        verdict = "✓ right" if self.passed else "✗ not yet"
        return (f'<p style="border-left: 4px solid {color}; padding-left: 0.6em">'
                f'<strong style="color: {color}">{verdict}</strong> — '
                f'<em>{html.escape(self.exercise)}</em>: {html.escape(self.message)}</p>')


class _Wrong(Exception):
    """Raised inside a checker to end it with a failing message."""


class _NotWritten(Exception):
    """The reader's stub still raises NotImplementedError."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_LIBRARY_DIRS = tuple({os.path.abspath(p) for p in (
    os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"],
    sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]) if p})


def _is_reader_file(filename: str) -> bool:
    """True for a frame of the reader's code: not the package, torch, the stdlib or a library."""
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    return not path.startswith(_PACKAGE_DIR) and not path.startswith(_LIBRARY_DIRS)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if len(text) <= 160 else text[:157] + "..."


def _describe_error(e: BaseException) -> str:
    """One sentence: where in the reader's code the error arose, and what it was."""
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if _is_reader_file(f.filename)]
    what = type(e).__name__ + (f" ({_first_line(e)})" if _first_line(e) else "")
    if mine:
        frame = mine[-1]
        code = f": `{frame.line.strip()}`" if frame.line and frame.line.strip() else ""
        return f"your code raised {what} at line {frame.lineno} of {frame.name}{code}."
    if isinstance(e, TypeError) and frames and frames[-1].filename == __file__:
        return (f"calling your code failed with {what}: its parameters and what it returns "
                f"should be as the task says.")
    where = ""
    if frames:
        last = frames[-1]
        where = f" in {os.path.basename(last.filename)}, line {last.lineno}"
    return (f"running your code through the package raised {what}{where}; check the types "
            f"and shapes your code returns against the task.")


def _exercise(name: str, chapter: int):
    """Decorate a checker: its body raises ``_Wrong(message)`` or returns the success
    message; reader exceptions become one sentence, a stub 'not written yet'."""

    def decorate(body):
        def checker(answer) -> Result:
            try:
                message = body(answer)
            except _Wrong as e:
                return Result(name, False, f"{e} See {CHAPTERS[chapter]}.")
            except _NotWritten:
                return Result(name, False, f"not written yet: replace `raise NotImplementedError` "
                                           f"in {_name_of(answer)} with your code, then run this "
                                           f"cell again.")
            except NotImplementedError:
                return Result(name, False, f"not written yet: replace `raise NotImplementedError` "
                                           f"in {_name_of(answer)} with your code, then run this "
                                           f"cell again.")
            except Exception as e:  # noqa: BLE001 - the reader's code may raise anything
                return Result(name, False, _describe_error(e) + f" See {CHAPTERS[chapter]}.")
            return Result(name, True, message)

        checker.__name__ = body.__name__
        checker.__qualname__ = body.__qualname__
        checker.__doc__ = body.__doc__
        checker.chapter = chapter
        checker.__wrapped__ = body
        return checker

    return decorate


def _name_of(answer) -> str:
    if isinstance(answer, tuple):
        return " or ".join(_name_of(a) for a in answer)
    name = getattr(answer, "__name__", None)
    return f"`{name}`" if name else "your code"


def _shape(cfg: Config) -> str:
    """A shape in words, short."""
    text = (f"{cfg.query_heads} query / {cfg.kv_heads} KV heads on {cfg.world_size} ranks")
    if (cfg.seq, cfg.batch, cfg.hidden, cfg.head_dim) != (5, 2, 16, 4):
        text += f" (seq {cfg.seq}, batch {cfg.batch}, hidden {cfg.hidden}, head_dim {cfg.head_dim})"
    if cfg.dtype != "float32":
        text += f" in {cfg.dtype}"
    return text


def _cases(configs=CHECKED_CONFIGS, seeds=CHECKED_SEEDS):
    """``(cfg, seed, x0, target, base)`` for every shape × seed, as ``tpattn.run`` draws them."""
    for cfg in configs:
        for seed in seeds:
            x0, target = make_inputs(cfg, seed)
            yield cfg, seed, x0, target, init_params(cfg, seed + PARAM_SEED_OFFSET)


def _coverage() -> str:
    return (f"{len(CHECKED_SEEDS)} seeds × {len(CHECKED_CONFIGS)} shapes, among them "
            f"{_shape(CHECKED_CONFIGS[1])} and {_shape(CHECKED_CONFIGS[2])}")


def _failing(metrics: dict) -> list[str]:
    return [m for m in MEASURES if metrics[m] >= TOLERANCE]


def _tensor(value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _Wrong(f"{what} should be a torch.Tensor, but your code gave "
                     f"{type(value).__name__}.")
    return value


def _expect_shape(t: torch.Tensor, shape, what: str) -> None:
    if list(t.shape) != list(shape):
        raise _Wrong(f"{what} has shape {list(t.shape)}; it should be {list(shape)}.")


# --- chapter 5 ------------------------------------------------------------------------------

_STEP_KEYS = ("output", "loss", "input_grad", "grads", "weights")
_STEP_HINTS = {
    "forward_max_abs_diff": "the output is not the dense block's: run "
                            "tpattn.dense_forward(x, p, cfg) on trainable copies of the inputs",
    "loss_abs_diff": "the loss is not the fixture's: the mean squared error of the output "
                     "against the target (torch.nn.functional.mse_loss)",
    "input_grad_max_abs_diff": "the input gradient is wrong: it is the .grad of a copy of x0 "
                               "that requires grad, after one backward of the loss",
    "parameter_grad_max_abs_diff": "the parameter gradients are wrong: they are the .grad of "
                                   "the trainable copies after one backward of the loss",
    "post_step_weight_max_abs_diff": f"the weights after the step are wrong: one SGD step "
                                     f"moves each parameter against its gradient, scaled by "
                                     f"the learning rate tpattn.check.core.LR = {LR}",
}


@_exercise("one SGD step", 5)
def check_train_step(train_step) -> str:
    """Check ``train_step(x0, target, params, cfg) -> dict``: one training step of the dense
    block (forward, MSE loss, backward, SGD with ``tpattn.check.core.LR``) that leaves ``params``
    untouched and returns ``output``, ``loss``, ``input_grad``, ``grads`` and ``weights``
    (by parameter name), as ``tpattn.check.core.one_step`` does."""
    for cfg, seed, x0, target, base in _cases():
        before = {k: v.clone() for k, v in base.items()}
        x_before = x0.clone()
        step = train_step(x0, target, base, cfg)
        if not all(torch.equal(base[k], before[k]) for k in base) or not torch.equal(x0, x_before):
            raise _Wrong("your step changed the starting parameters or x0 in place; the step "
                         "must work on trainable copies (tpattn.clone_trainable) so the start "
                         "stays available for the dense-vs-TP comparison.")
        if not isinstance(step, dict) or any(k not in step for k in _STEP_KEYS):
            raise _Wrong(f"your step should return a dict with the keys {', '.join(_STEP_KEYS)}.")
        if step["input_grad"] is None:
            raise _Wrong("input_grad is None: x has no gradient — make a copy of x0 that "
                         "requires grad before the forward.")
        for key in ("grads", "weights"):
            if not isinstance(step[key], dict) or any(
                    not isinstance(step[key].get(k), torch.Tensor) for k in PARAM_NAMES):
                raise _Wrong(f"step['{key}'] should map each of {', '.join(PARAM_NAMES)} to "
                             f"a tensor.")
        for key in ("output", "loss", "input_grad"):
            _tensor(step[key], f"step['{key}']")
        metrics = five_measures(seed, "your step", dense_reference(x0, target, base, cfg), step)
        failing = _failing(metrics)
        if failing:
            first = failing[0]
            raise _Wrong(f"for seed {seed}, {_shape(cfg)}, {_STEP_HINTS[first]} (differs from "
                         f"the reference by {metrics[first]:.1e}).")
    return (f"your step matches the dense reference on all five measures for {_coverage()}, "
            f"and leaves its inputs untouched.")


@_exercise("the five measures", 5)
def check_five_measures(measures) -> str:
    """Check ``measures(dense, tp) -> dict``: the five measures (keys ``tpattn.MEASURES``,
    Python floats) between two ``one_step`` dicts, on the dense side and the TP side of every
    mode (each mode fails a different set of measures)."""
    hints = {"forward_max_abs_diff": "the largest absolute difference of the outputs",
             "loss_abs_diff": "the absolute difference of the losses",
             "input_grad_max_abs_diff": "the largest absolute difference of the input gradients",
             "parameter_grad_max_abs_diff": "the largest absolute difference over the gradients "
                                            "of all five parameters",
             "post_step_weight_max_abs_diff": "the largest absolute difference over all five "
                                              "parameters after the step"}
    count = 0
    for cfg, seed, x0, target, base in _cases(CHECKED_CONFIGS[:2]):
        dense = dense_reference(x0, target, base, cfg)
        for mode in MODES:
            tp = tp_step(x0, target, base, cfg, resolve(mode, cfg).injection, "ranks")
            want = five_measures(seed, mode, dense, tp)
            got = measures(dense, tp)
            if not isinstance(got, dict):
                raise _Wrong(f"your function should return a dict keyed by the five measure "
                             f"names, but it gave {type(got).__name__}.")
            missing = [m for m in MEASURES if m not in got]
            if missing:
                raise _Wrong(f"your dict lacks {', '.join(missing)}; the keys are "
                             f"tpattn.MEASURES.")
            for m in MEASURES:
                try:
                    value = float(got[m])
                except (TypeError, ValueError):
                    raise _Wrong(f"{m} should be a number, but your code gave "
                                 f"{type(got[m]).__name__}.") from None
                # Two correct ways differ by at most one float32 rounding of the difference.
                if not abs(value - want[m]) <= 1e-6 * abs(want[m]) + 1e-12:
                    raise _Wrong(f"{m} is not {hints[m]}: for seed {seed}, {mode}, "
                                 f"{_shape(cfg)} yours is {value:.2e}, the package's "
                                 f"{want[m]:.2e}.")
            count += 1
    return (f"all five of your measures agree with the package's on {count} comparisons: "
            f"every mode, {len(CHECKED_SEEDS)} seeds, two shapes (up to 4 ranks).")


# --- chapter 6 ------------------------------------------------------------------------------

def _head_of(block: torch.Tensor, dense: torch.Tensor, rows_per_head: int) -> int | None:
    """Which head of ``dense`` (blocks of ``rows_per_head`` rows) ``block`` is, or None."""
    for h in range(dense.shape[0] // rows_per_head):
        if torch.equal(block, dense[h * rows_per_head:(h + 1) * rows_per_head]):
            return h
    return None


def _heads_held(shard: torch.Tensor, dense: torch.Tensor, d: int, what: str, rank: int) -> list[int]:
    heads = []
    for i in range(shard.shape[0] // d):
        h = _head_of(shard[i * d:(i + 1) * d].detach(), dense.detach(), d)
        if h is None:
            raise _Wrong(f"rank {rank}'s {what} rows {i * d}..{(i + 1) * d - 1} are not one "
                         f"whole head of the dense {what}: a head's head_dim rows stay together.")
        heads.append(h)
    return heads


@_exercise("shard_params", 6)
def check_shard_params(shard) -> str:
    """Check ``shard(params, cfg) -> list[dict]``: one dict per rank with ``norm`` (replicated)
    and that rank's head-group shards of ``wq``, ``wk``, ``wv`` (rows) and ``wo`` (columns),
    cut so that gradients reach ``params``. Graded by what each rank holds and by the five
    measures of ``tpattn.run(..., shard_fn=shard)``."""
    for cfg, seed, x0, target, base in _cases():
        d, g = cfg.head_dim, cfg.group_size
        params = clone_trainable(base)
        shards = shard(params, cfg)
        if not isinstance(shards, (list, tuple)) or len(shards) != cfg.world_size:
            raise _Wrong(f"for {_shape(cfg)} your function should return a list of "
                         f"{cfg.world_size} dicts, one per rank.")
        expected = {"norm": [cfg.hidden], "wq": [cfg.local_query_heads * d, cfg.hidden],
                    "wk": [cfg.local_kv_heads * d, cfg.hidden],
                    "wv": [cfg.local_kv_heads * d, cfg.hidden],
                    "wo": [cfg.hidden, cfg.local_query_heads * d]}
        held_q, held_kv = [], []
        for rank, mine in enumerate(shards):
            if not isinstance(mine, dict) or any(k not in mine for k in PARAM_NAMES):
                raise _Wrong(f"rank {rank}'s shard should be a dict with the keys "
                             f"{', '.join(PARAM_NAMES)}.")
            for k in PARAM_NAMES:
                t = _tensor(mine[k], f"rank {rank}'s {k}")
                _expect_shape(t, expected[k], f"for {_shape(cfg)}, rank {rank}'s {k}")
            q = _heads_held(mine["wq"], params["wq"], d, "wq", rank)
            kv = _heads_held(mine["wk"], params["wk"], d, "wk", rank)
            if _heads_held(mine["wv"], params["wv"], d, "wv", rank) != kv:
                raise _Wrong(f"rank {rank} holds other heads of wv than of wk; a KV head's "
                             f"key and value rows go together.")
            o = _heads_held(mine["wo"].t(), params["wo"].t(), d, "wo column", rank)
            if o != q:
                raise _Wrong(f"rank {rank}'s wo columns belong to query heads {o}, but it "
                             f"computes query heads {q}: wo's columns must match the rank's "
                             f"own heads.")
            for i, h in enumerate(q):
                if h // g not in kv:
                    raise _Wrong(f"for {_shape(cfg)}, rank {rank} holds query heads {q} and "
                                 f"KV heads {kv}: query head {h} reads KV head {h // g}, "
                                 f"which is not on rank {rank} — a split group.")
                if kv[i // g] != h // g:
                    raise _Wrong(f"rank {rank} holds the right heads in the wrong order: its "
                                 f"query head {h} would read KV head {kv[i // g]} "
                                 f"(repeat_kv pairs local query head i with local KV head "
                                 f"i // group_size).")
            held_q += q
            held_kv += kv
        if sorted(held_q) != list(range(cfg.query_heads)) or \
                sorted(held_kv) != list(range(cfg.kv_heads)):
            raise _Wrong(f"for {_shape(cfg)} some head is on two ranks or on none (query "
                         f"heads held: {sorted(held_q)}, KV heads: {sorted(held_kv)}).")
        tp_forward(x0, params, cfg, shard_fn=shard).sum().backward()
        unreached = [k for k in PARAM_NAMES if params[k].grad is None]
        metrics = None if unreached else run(seed, EQUIVALENCE, cfg, shard_fn=shard)
        failing = _failing(metrics) if metrics else ["parameter_grad_max_abs_diff"]
        if failing and "forward_max_abs_diff" not in failing:
            raise _Wrong("every rank holds the right heads and the forward matches, but the "
                         "gradients do not reach the dense parameters"
                         + (f" ({', '.join(unreached)} get none)" if unreached else "")
                         + ": a shard must be a differentiable slice of params (no detach, "
                         "no new tensor).")
        if failing:
            raise _Wrong(f"the sharded block differs from dense for seed {seed}, "
                         f"{_shape(cfg)} (fails {', '.join(failing)}).")
    return (f"every rank holds complete query/KV groups with the matching wo columns, "
            f"gradients reach the dense parameters, and tpattn.run(..., shard_fn=yours) "
            f"passes all five measures for {_coverage()}.")


def _layout_shard_fn(layout):
    """A ``shard_fn`` that gives rank r the query heads ``layout[r]["query"]`` and KV heads
    ``layout[r]["kv"]`` (sorted), with the matching wq/wk/wv rows and wo columns."""

    def shard_fn(params, cfg):
        d = cfg.head_dim

        def rows(heads):
            return torch.tensor([h * d + i for h in sorted(heads) for i in range(d)])

        return [{"norm": params["norm"], "wq": params["wq"][rows(r["query"])],
                 "wk": params["wk"][rows(r["kv"])], "wv": params["wv"][rows(r["kv"])],
                 "wo": params["wo"][:, rows(r["query"])]} for r in layout]

    return shard_fn


def _layouts(cfg: Config, rng: random.Random) -> list[list[dict]]:
    """Balanced layouts (every rank as many heads as the package gives it): the package's,
    groups moved between ranks, query heads shuffled, and one query head swapped."""
    w, g = cfg.world_size, cfg.group_size
    lq, lkv = cfg.local_query_heads, cfg.local_kv_heads

    def from_lists(query, kv):
        return [{"query": sorted(query[r * lq:(r + 1) * lq]), "kv": sorted(kv[r * lkv:(r + 1) * lkv])}
                for r in range(w)]

    package = []
    for rank in range(w):
        q_rows, kv_rows = rank_head_slices(cfg, rank)
        package.append({"query": list(range(q_rows.start // cfg.head_dim, q_rows.stop // cfg.head_dim)),
                        "kv": list(range(kv_rows.start // cfg.head_dim, kv_rows.stop // cfg.head_dim))})
    layouts = [package]
    for _ in range(2):  # whole groups moved to other ranks
        kv = list(range(cfg.kv_heads))
        rng.shuffle(kv)
        layouts.append(from_lists([k * g + i for k in kv for i in range(g)], kv))
    for _ in range(2):  # query heads shuffled, KV heads where the package puts them
        query = list(range(cfg.query_heads))
        rng.shuffle(query)
        layouts.append(from_lists(query, list(range(cfg.kv_heads))))
    swapped = [{"query": list(r["query"]), "kv": list(r["kv"])} for r in package]
    swapped[0]["query"][-1], swapped[-1]["query"][0] = swapped[-1]["query"][0], swapped[0]["query"][-1]
    layouts.append([{"query": sorted(r["query"]), "kv": r["kv"]} for r in swapped])
    return layouts


def _layout_text(layout) -> str:
    return "; ".join(f"rank {r}: query {part['query']}, KV {part['kv']}"
                     for r, part in enumerate(layout))


@_exercise("detect a split group", 6)
def check_keeps_groups(keeps_groups) -> str:
    """Check ``keeps_groups(layout, cfg) -> bool``: whether a layout — per rank a dict with
    the sorted lists ``"query"`` and ``"kv"`` of the heads it holds — keeps every query/KV
    group on one rank. Graded against the sharded block itself: a layout is right exactly when
    ``tpattn.run(seed, "equivalence", cfg, shard_fn=that layout)`` passes."""
    rng = random.Random(13)
    count = 0
    for cfg in CHECKED_CONFIGS:
        for layout in _layouts(cfg, rng):
            truth = run(11, EQUIVALENCE, cfg, shard_fn=_layout_shard_fn(layout))["passed"]
            answer = keeps_groups([{"query": list(p["query"]), "kv": list(p["kv"])}
                                   for p in layout], cfg)
            if not isinstance(answer, bool) and not (
                    isinstance(answer, torch.Tensor) and answer.numel() == 1):
                raise _Wrong(f"your function should return True or False, but it gave "
                             f"{type(answer).__name__}.")
            if bool(answer) != truth:
                verdict = ("keeps groups complete, but the sharded block with this layout "
                           "differs from dense" if answer else
                           "splits a group, but the sharded block with this layout matches "
                           "dense on all five measures")
                raise _Wrong(f"for {_shape(cfg)} and the layout {_layout_text(layout)}, you "
                             f"said it {verdict}.")
            count += 1
    return (f"right on all {count} layouts (three shapes, the package's layout, groups moved "
            f"between ranks and shuffled heads), each graded by running the sharded block.")


# --- chapter 7 ------------------------------------------------------------------------------

def _probe(collective, world_size: int, name: str) -> tuple[list, list, list, list]:
    """Run ``collective.apply`` on random per-rank tensors and backward with random output
    gradients; return (inputs, outputs, output gradients, input gradients)."""
    gen = torch.Generator().manual_seed(7)
    ts = [torch.randn(3, 2, 4, generator=gen).requires_grad_(True) for _ in range(world_size)]
    cs = [torch.randn(3, 2, 4, generator=gen) for _ in range(world_size)]
    outs = collective.apply(*ts)
    if isinstance(outs, torch.Tensor) or not isinstance(outs, (tuple, list)) or len(outs) != world_size:
        raise _Wrong(f"{name}.apply(*tensors) with {world_size} tensors should return "
                     f"{world_size} tensors, one per rank.")
    for r, o in enumerate(outs):
        _expect_shape(_tensor(o, f"{name}'s output for rank {r}"), ts[r].shape,
                      f"{name}'s output for rank {r}")
    loss = sum((o * c).sum() for o, c in zip(outs, cs))
    loss.backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ts]
    return ts, [o.detach() for o in outs], cs, grads


def _close(a: torch.Tensor, b: torch.Tensor, terms: int) -> bool:
    """Equal up to the rounding of a float32 sum of ``terms`` terms of size ~ max |b|."""
    bound = 4 * terms * torch.finfo(torch.float32).eps * max(1.0, b.abs().max().item())
    return bool((a - b).abs().max() <= bound)


def _check_collective(collective, name: str, sums_forward: bool) -> None:
    """The probe's verdict on an f (identity forward, summing backward) or a g (summing
    forward, identity backward)."""
    for world_size in (2, 4):
        ts, outs, cs, grads = _probe(collective, world_size, name)
        total = sum(t.detach() for t in ts)
        total_c = sum(cs)
        for r in range(world_size):
            want = total if sums_forward else ts[r].detach()
            if not _close(outs[r], want, world_size):
                if sums_forward and _close(outs[r], ts[r].detach(), 1):
                    raise _Wrong(f"{name}'s forward hands rank {r} its own tensor back; g's "
                                 f"forward gives every rank the sum of all ranks' partials.")
                if not sums_forward and _close(outs[r], total, world_size):
                    raise _Wrong(f"{name}'s forward sums the ranks' tensors; f's forward is the "
                                 f"identity — every rank already holds the same n.")
                raise _Wrong(f"with {world_size} ranks, {name}'s forward output for rank {r} "
                             f"is neither its own tensor nor the sum of all ranks' tensors.")
        for r in range(world_size):
            want = cs[r] if sums_forward else total_c
            if not _close(grads[r], want, world_size):
                if sums_forward and _close(grads[r], total_c, world_size):
                    raise _Wrong(f"{name}'s backward sums the ranks' gradients; g's backward is "
                                 f"the identity — each rank's partial gets its own output's "
                                 f"gradient (a sum would count it once per rank).")
                if not sums_forward and _close(grads[r], cs[r], 1):
                    raise _Wrong(f"{name}'s backward passes each rank its own gradient; f's "
                                 f"backward gives every rank the sum of all ranks' dn.")
                raise _Wrong(f"with {world_size} ranks, the gradient {name}'s backward gives "
                             f"rank {r} is neither its own nor the sum of all ranks'.")


def _block_with(f, g) -> str:
    """Run the simulated ranks with the given f and g; return the success text or raise."""
    for cfg, seed, x0, target, base in _cases():
        step = simulated_step(shard_params(base, cfg), [(x0, target)] * cfg.world_size, cfg,
                              Injection(), LR, f=f, g=g)
        metrics = five_measures(seed, EQUIVALENCE, dense_reference(x0, target, base, cfg),
                                rank0_view(step, cfg))
        failing = _failing(metrics)
        if failing:
            raise _Wrong(f"in the sharded block, for seed {seed}, {_shape(cfg)}, it fails "
                         f"{', '.join(failing)}.")
    return f"the sharded block with it equals dense on all five measures for {_coverage()}"


@_exercise("g as an autograd Function", 7)
def check_g(g) -> str:
    """Check a ``torch.autograd.Function`` ``g`` for simulated ranks: ``g.apply(*partials)``
    (one tensor per rank) returns one tensor per rank — forward: the sum of all ranks'
    partials on every rank; backward: identity. Probed alone on 2 and 4 ranks, then plugged
    into every rank's forward (the engine's block, ``tpattn.parallel.simulated``, with the
    package's f)."""
    _check_collective(g, _plain_name(g, "g"), sums_forward=True)
    return ("forward sums, backward is the identity (probed on 2 and 4 ranks), and "
            + _block_with(None, g) + ".")


@_exercise("f as an autograd Function", 7)
def check_f(f) -> str:
    """Check a ``torch.autograd.Function`` ``f`` for simulated ranks: ``f.apply(*ns)`` (one
    tensor per rank) returns one tensor per rank — forward: identity; backward: every rank
    receives the sum of all ranks' gradients. Probed alone on 2 and 4 ranks, then plugged into
    every rank's forward (the engine's block, ``tpattn.parallel.simulated``, with the
    package's g)."""
    _check_collective(f, _plain_name(f, "f"), sums_forward=False)
    return ("forward is the identity, backward sums (probed on 2 and 4 ranks), and "
            + _block_with(f, None) + ".")


def _plain_name(obj, default: str) -> str:
    if not (isinstance(obj, type) and issubclass(obj, torch.autograd.Function)):
        raise _Wrong(f"{default} should be a subclass of torch.autograd.Function (a class with "
                     f"static forward and backward), but it is {type(obj).__name__}.")
    return obj.__name__


# --- chapters 8 and 9: predictions ----------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _mode_runs(mode: str) -> tuple[tuple[frozenset, frozenset], ...]:
    """For every checked case of ``mode`` (seed × shape × simulation): the measures that fail
    and the parameters whose gradients are wrong (computed once per session)."""
    found = []
    for cfg, seed, x0, target, base in _cases():
        dense = dense_reference(x0, target, base, cfg)
        for simulate in SIMULATIONS:
            tp = tp_step(x0, target, base, cfg, resolve(mode, cfg).injection, simulate)
            hit = frozenset(k for k in PARAM_NAMES
                            if max_abs_diff(dense["grads"][k], tp["grads"][k]) >= TOLERANCE)
            found.append((frozenset(_failing(five_measures(seed, mode, dense, tp))), hit))
    return tuple(found)


def _as_names(prediction, allowed, what: str) -> set[str]:
    if isinstance(prediction, str) or not isinstance(prediction, (set, frozenset, list, tuple)):
        raise _Wrong(f"your prediction should be a set of {what} names (e.g. {{'{allowed[0]}'}}), "
                     f"but it is {type(prediction).__name__}.")
    unknown = [p for p in prediction if p not in allowed]
    if unknown:
        raise _Wrong(f"{', '.join(map(repr, unknown))} is not one of the {what} names: "
                     f"{', '.join(allowed)}.")
    return set(prediction)


def _grade_prediction(predicted: set, found: list[set], what: str, mode: str, order,
                      shapes: int = len(CHECKED_CONFIGS),
                      seeds: int = len(CHECKED_SEEDS)) -> str:
    """Compare a predicted set with the sets found on every run (all runs must agree)."""
    always = set.intersection(*found)
    sometimes = set.union(*found)
    if always != sometimes:  # not seen in the package so far; say it rather than guess
        raise _Wrong(f"the runs of {mode} do not agree on which {what} fail; no single "
                     f"prediction is right.")
    missed = [n for n in order if n in always - predicted]
    extra = [n for n in order if n in predicted - always]
    if missed or extra:
        parts = []
        if missed:
            parts.append(f"you left out {', '.join(missed)}, which fail{'s' if len(missed) == 1 else ''} "
                         f"on every run")
        if extra:
            parts.append(f"you named {', '.join(extra)}, which pass{'es' if len(extra) == 1 else ''} "
                         f"on every run")
        raise _Wrong(f"not quite: {' and '.join(parts)} of {mode} ({len(found)} runs: "
                     f"{seeds} seeds × {shapes} shapes × both "
                     f"simulations).")
    return (f"right: on all {len(found)} runs of {mode} ({seeds} seeds × "
            f"{shapes} shapes × the fixture's and the per-rank simulation), "
            f"exactly the {what} you named fail.")


def _check_signature(predict, mode: str) -> str:
    predicted = _as_names(predict(), MEASURES, "measure")
    found = [set(failing) for failing, _ in _mode_runs(mode)]
    return _grade_prediction(predicted, found, "measures", mode, MEASURES)


@_exercise("predict missing g's signature", 8)
def check_missing_g_signature(predict) -> str:
    """Check ``predict() -> set``: the names (``tpattn.MEASURES``) of the measures that fail
    when g, the forward all-reduce of the output partials, is missing. Graded against real
    runs of ``missing_output_reduce``."""
    return _check_signature(predict, MISSING_OUTPUT_REDUCE)


@_exercise("the fingerprint of a missing g", 8)
def check_fingerprint(fingerprint) -> str:
    """Check ``fingerprint(x, params, cfg) -> [S, B, hidden]``: the dense output minus the
    output of the block without g (``tp_forward(..., reduce_output=False)``, rank 0's view),
    computed from the ranks' partials. Compared with the actual difference up to float32
    rounding of the sums involved."""
    for cfg, seed, x0, target, base in _cases():
        with torch.no_grad():
            actual = dense_forward(x0, base, cfg) - tp_forward(x0, base, cfg, reduce_output=False)
            n = rms_norm(x0, base["norm"], cfg.eps)
            partials = [attend_and_project(n, s, cfg) for s in shard_params(base, cfg)]
        got = fingerprint(x0.clone(), {k: v.clone() for k, v in base.items()}, cfg)
        got = _tensor(got, "your fingerprint").detach()
        _expect_shape(got, actual.shape, f"for {_shape(cfg)} your fingerprint")
        # Both sides add up to world_size + 1 terms of size <= scale, each with float32 rounding.
        scale = (x0.abs() + sum(p.abs() for p in partials)).max().item()
        bound = 4 * (cfg.world_size + 1) * torch.finfo(cfg.torch_dtype).eps * scale

        def near(t):
            return bool((got - t).abs().max() <= bound)

        if not near(actual):
            if near(partials[0]):
                hint = "that is rank 0's own partial, the one the buggy block keeps"
            elif near(sum(partials)):
                hint = "that is the whole branch, every rank's partial"
            elif near(-actual):
                hint = "the sign is flipped: dense minus the buggy output"
            else:
                hint = f"it is off by up to {(got - actual).abs().max().item():.1e}"
            raise _Wrong(f"for seed {seed}, {_shape(cfg)}: {hint}.")
    return (f"your fingerprint equals dense − (block without g) up to float32 rounding for "
            f"{_coverage()}: the forward error of a missing g is exactly what rank 0 misses.")


@_exercise("predict missing f's signature", 9)
def check_missing_f_signature(predict) -> str:
    """Check ``predict() -> set``: the names (``tpattn.MEASURES``) of the measures that fail
    when f's backward all-reduce of dn is missing. Graded against real runs of
    ``missing_input_grad_reduce``."""
    return _check_signature(predict, MISSING_INPUT_GRAD_REDUCE)


@_exercise("which parameters a missing f hits", 9)
def check_missing_f_parameters(predict) -> str:
    """Check ``predict() -> set``: the names (``tpattn.block.params.PARAM_NAMES``) of the parameters
    whose gradients are wrong when f is missing. Graded against real runs of
    ``missing_input_grad_reduce``, parameter by parameter."""
    predicted = _as_names(predict(), PARAM_NAMES, "parameter")
    found = [set(hit) for _, hit in _mode_runs(MISSING_INPUT_GRAD_REDUCE)]
    return _grade_prediction(predicted, found, "parameter gradients", MISSING_INPUT_GRAD_REDUCE,
                             PARAM_NAMES)


# --- chapter 10 -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _real_runs() -> tuple[dict, ...]:
    return tuple(run(seed, mode, cfg, simulate)
                 for cfg in CHECKED_CONFIGS for seed in CHECKED_SEEDS
                 for mode in MODES for simulate in SIMULATIONS)


def _real_results() -> list[dict]:
    """``tpattn.run`` for every checked seed × shape × mode × simulation (fresh copies)."""
    return [dict(r) for r in _real_runs()]


def _synthetic(failing: tuple, below: float = 0.5) -> dict:
    """A result dict where exactly ``failing`` fail: those at exactly TOLERANCE (the smallest
    failing value), the rest at ``below`` × TOLERANCE."""
    result = {"seed": 0, "mode": "unknown"}
    for m in MEASURES:
        result[m] = TOLERANCE if m in failing else below * TOLERANCE
    result["passed"] = not failing
    return result


#: Signatures no mode of the package produces (the checkers' "unknown" cases).
_UNKNOWN_SIGNATURES = (("loss_abs_diff",), ("post_step_weight_max_abs_diff",),
                       ("forward_max_abs_diff",), ("input_grad_max_abs_diff",),
                       MEASURES[3:])


def _expected_signature(result: dict) -> tuple:
    return tuple(m for m in MEASURES if result[m] >= TOLERANCE)


def _result_text(result: dict) -> str:
    if result["mode"] == "unknown":
        failing = _expected_signature(result)
        return (f"a made-up result where {', '.join(failing) or 'nothing'} "
                f"{'is' if len(failing) == 1 else 'are'} at TOLERANCE and the rest below")
    return f"seed {result['seed']}, {result['mode']}"


@_exercise("a signature", 10)
def check_signature(signature) -> str:
    """Check ``signature(result) -> tuple``: the names of the measures that fail
    (``>= tpattn.TOLERANCE``), in ``tpattn.MEASURES`` order, for a ``tpattn.run`` dict.
    Graded on made-up results at the threshold and on real runs of every mode."""
    cases = [_synthetic(s) for s in _UNKNOWN_SIGNATURES] + [_synthetic(())] + _real_results()
    for result in cases:
        got = signature(dict(result))
        want = _expected_signature(result)
        if not isinstance(got, tuple):
            if isinstance(got, (list, set, frozenset)) and set(got) == set(want):
                raise _Wrong(f"the right measures, as a {type(got).__name__}; return a tuple "
                             f"in MEASURES order, so two signatures compare equal.")
            raise _Wrong(f"your function should return a tuple of measure names, but it gave "
                         f"{type(got).__name__}.")
        if got != want:
            if set(got) == set(want):
                raise _Wrong(f"the right measures in the wrong order for {_result_text(result)}; "
                             f"keep MEASURES order.")
            wrong_fail = [m for m in got if m not in want]
            wrong_pass = [m for m in want if m not in got]
            parts = []
            if wrong_fail:
                parts.append(f"you count {', '.join(wrong_fail)} as failing, but "
                             f"{'it is' if len(wrong_fail) == 1 else 'they are'} below TOLERANCE")
            if wrong_pass:
                parts.append(f"you count {', '.join(wrong_pass)} as passing, but a measure "
                             f"at or above TOLERANCE fails")
            raise _Wrong(f"for {_result_text(result)}: {'; '.join(parts)}.")
    return (f"right on {len(cases)} results: made-up ones at the threshold and real runs of "
            f"every mode, {len(CHECKED_SEEDS)} seeds, {len(CHECKED_CONFIGS)} shapes, both "
            f"simulations.")


@_exercise("diagnose a signature", 10)
def check_diagnose(diagnose) -> str:
    """Check ``diagnose(result) -> str | None``: from a ``tpattn.run`` dict's measures alone,
    the mode that leaves that signature (``"equivalence"``, ``"missing_output_reduce"``,
    ``"missing_input_grad_reduce"``), or ``None`` for a signature no mode leaves. The modes'
    signatures are read off real runs; made-up results carry the other signatures."""
    real = _real_results()
    modes_of = {}
    for r in real:
        modes_of.setdefault(_expected_signature(r), set()).add(r["mode"])
    if any(len(v) != 1 for v in modes_of.values()):  # pragma: no cover - package invariant
        raise _Wrong("two modes share a signature in these runs; no diagnosis can tell them apart.")
    mode_of = {sig: next(iter(modes)) for sig, modes in modes_of.items()}
    cases = real + [_synthetic(s) for s in _UNKNOWN_SIGNATURES if s not in mode_of]
    for result in cases:
        got = diagnose({k: v for k, v in result.items() if k != "mode"})
        want = mode_of.get(_expected_signature(result))
        if got != want:
            if got is not None and got not in MODES:
                raise _Wrong(f"your function returned {got!r}; return one of "
                             f"{', '.join(MODES)}, or None for a signature no mode leaves.")
            said = "None" if got is None else got
            raise _Wrong(f"for {_result_text(result)} (failing: "
                         f"{', '.join(_expected_signature(result)) or 'nothing'}) you said "
                         f"{said}; "
                         + (f"the run came from {want}." if want else
                            "no mode leaves that signature, so the answer is None."))
    return (f"right on {len(cases)} results: every real run ({len(real)}: every mode, "
            f"{len(CHECKED_SEEDS)} seeds, {len(CHECKED_CONFIGS)} shapes, both simulations) "
            f"and every made-up signature that no mode leaves.")


# --- chapter 11 -----------------------------------------------------------------------------

def _recorded_step(cfg: Config, mode: str = EQUIVALENCE):
    """Rank 0's training step of ``mode``'s injection through ``tpattn.real.ranks``'s real
    ``real_rank_block`` (``CopyToRanks``, ``ReduceOutputPartials``) with a ledger that records what each collective
    is handed and does not communicate (one process, no process group: rank 0's values stay its
    own; only the counts and sizes are used). Returns ``(counts, carried)``: the ledger's
    all-reduces by phase, and bytes carried per collective label."""
    from tpattn.check.core import one_step
    from tpattn.real.ranks import CollectiveLedger, real_rank_block

    class RecordingLedger(CollectiveLedger):
        def __init__(self):
            super().__init__()
            self.carried = {}

        def _record(self, *args):  # sizes come from the tensors themselves, not a group
            pass

        def _issue(self, label, collective, *args, group=None):
            self.issued += 1
            self.history.append(label)
            tensor = args[0]
            self.carried[label] = self.carried.get(label, 0) + tensor.numel() * tensor.element_size()

    ledger = RecordingLedger()
    x0, target = make_inputs(cfg, 11)
    base = init_params(cfg, 11 + PARAM_SEED_OFFSET)
    inj = resolve(mode, cfg).injection
    one_step(lambda x, shard: real_rank_block(x, shard, cfg, inj, ledger, rank=0),
             x0, target, shard_params(base, cfg)[0])
    return dict(ledger.counts), ledger.carried


def _recorded_bytes(cfg: Config) -> dict[str, int]:
    """Bytes each of f's and g's all-reduces carries on one rank in one training step."""
    from tpattn.real.ranks import F_ALL_REDUCE, G_ALL_REDUCE
    _, carried = _recorded_step(cfg)
    return {"f": carried.get(F_ALL_REDUCE, 0), "g": carried.get(G_ALL_REDUCE, 0)}


#: Shapes the bytes exercise is graded on: the checked ones, a float64 one and a wider one.
BYTES_CONFIGS = CHECKED_CONFIGS + (
    Config(dtype="float64"),
    Config(seq=7, batch=3, hidden=32, query_heads=8, kv_heads=2, head_dim=4, world_size=2),
)


@_exercise("bytes f and g move", 11)
def check_bytes_per_step(bytes_per_step) -> str:
    """Check ``bytes_per_step(cfg) -> {"f": int, "g": int}``: the bytes of the tensor each of
    f's and g's all-reduces carries on one rank in one training step (forward and backward),
    compared with the tensors the real ranks' collectives hand the ledger."""
    for cfg in BYTES_CONFIGS:
        want = _recorded_bytes(cfg)
        got = bytes_per_step(cfg)
        if not isinstance(got, dict) or set(got) != {"f", "g"}:
            raise _Wrong("your function should return a dict with the keys 'f' and 'g'.")
        for name in ("f", "g"):
            value = got[name]
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _Wrong(f"'{name}' should be a number of bytes, but it is "
                             f"{type(value).__name__}.")
            if value != want[name]:
                hint = ""
                if value * 2 == want[name] and cfg.dtype == "float64":
                    hint = " — an element's size depends on cfg.dtype"
                elif value * cfg.world_size == want[name]:
                    hint = (" — that is divided by the ranks: an all-reduce's tensor is not "
                            "sharded, every rank sends its full-size one")
                raise _Wrong(f"for {_shape(cfg)}, {name}'s all-reduce carries {want[name]} "
                             f"bytes per rank per step; you said {value:g}{hint}.")
    return (f"right for all {len(BYTES_CONFIGS)} shapes, float64 among them: the sizes match "
            f"the tensors the real ranks' f and g hand the ledger.")


@_exercise("the ledger's counts", 11)
def check_ledger_counts(ledger_counts) -> str:
    """Check ``ledger_counts(mode) -> {"forward": int, "backward": int}``: how many all-reduces
    one rank's training step of the block issues in each autograd phase, for each mode —
    compared with the counts the ledger records when the real ranks' f and g run."""
    for cfg in CHECKED_CONFIGS[:2]:
        for mode in MODES:
            want, _ = _recorded_step(cfg, mode)
            got = ledger_counts(mode)
            if not isinstance(got, dict) or set(got) != {"forward", "backward"}:
                raise _Wrong("your function should return a dict with the keys 'forward' and "
                             "'backward'.")
            for phase in ("forward", "backward"):
                if got[phase] != want[phase]:
                    raise _Wrong(f"for {mode}, one rank's step issues {want[phase]} "
                                 f"all-reduce{'s' if want[phase] != 1 else ''} in the {phase} "
                                 f"pass; you said {got[phase]!r}.")
    return (f"right for every mode, on 2 and 4 ranks: the counts match what the ledger records "
            f"when the real ranks' f and g run.")


def _real_fg_rank(rank: int, plan, device, on_progress) -> list | None:
    """One rank of ``check_real_f_and_g``: every checked seed's training step with the reader's
    f and g, gathered to rank 0 and compared with dense there (module level: started by
    ``tpattn.real.launch.run_on_ranks``)."""
    from tpattn.check.core import one_step
    from tpattn.block.params import unshard_params
    from tpattn.real.ranks import CollectiveLedger, gather_step

    cfg, seeds, f, g = plan
    ledger = CollectiveLedger()
    results = []
    for index, seed in enumerate(seeds):
        x0, target = make_inputs(cfg, seed)
        base = init_params(cfg, seed + PARAM_SEED_OFFSET)

        def forward(x, shard):
            n = f.apply(rms_norm(x, shard["norm"], cfg.eps))
            return x + g.apply(attend_and_project(n, shard, cfg))

        step = one_step(forward, x0, target, shard_params(base, cfg)[rank])
        gathered = gather_step(ledger, rank, step, lambda per_rank: unshard_params(per_rank, cfg))
        if gathered is not None:
            results.append(five_measures(seed, EQUIVALENCE,
                                         dense_reference(x0, target, base, cfg), gathered[1]))
        on_progress(index)
    return results if rank == 0 else None


@_exercise("f and g on real ranks", 11)
def check_real_f_and_g(f_and_g) -> str:
    """Check ``(F, G)``: f and g as ``torch.autograd.Function`` subclasses for real ranks —
    ``F.apply(n)`` and ``G.apply(partial)`` on one rank's ``[S, B, hidden]`` tensor, calling
    ``torch.distributed.all_reduce`` themselves. Runs them on 2 gloo ranks (processes forked
    from this one, so classes defined in a notebook reach them) for the checked seeds, and
    compares rank 0's gathered step with dense on the five measures."""
    from tpattn.real.launch import RankFailure, run_on_ranks

    if not isinstance(f_and_g, tuple) or len(f_and_g) != 2:
        raise _Wrong("pass the two classes as a tuple (F, G).")
    f, g = f_and_g
    _plain_name(f, "F")
    _plain_name(g, "G")
    cfg = Config()
    try:
        results, _ = run_on_ranks(_real_fg_rank, cfg.world_size, (cfg, CHECKED_SEEDS, f, g),
                                  timeout=20.0, backend="gloo", start_method="fork")
    except RankFailure as e:
        text = str(e).removeprefix("real-rank run failed: ")
        if "NotImplementedError" in text:
            raise _NotWritten() from None
        raise _Wrong(f"on real ranks, {text}.") from None
    for metrics in results[0]:
        failing = _failing(metrics)
        if "forward_max_abs_diff" in failing:
            raise _Wrong(f"on real ranks the output is not dense's (seed {metrics['seed']}): "
                         f"G's forward must leave every rank with the sum of all ranks' "
                         f"partials.")
        if failing:
            raise _Wrong(f"on real ranks the forward is right but {', '.join(failing)} fail "
                         f"(seed {metrics['seed']}): F's backward must all-reduce dn, and G's "
                         f"backward must pass the gradient through unchanged.")
    return (f"on 2 real gloo ranks your F and G give dense's step on all five measures for "
            f"{len(CHECKED_SEEDS)} seeds.")


# --- chapter 12 -----------------------------------------------------------------------------

#: Seeds of the slower checkers (chapters 12 on): one of the fixture's, one never shown.
EXTRA_SEEDS = (11, 5)
#: Shapes the sequence-parallel exercises are graded on (seq a multiple of world_size): 2 ranks;
#: 4 ranks with 2 query heads each; 3 ranks, batch 1, hidden 8.
SP_CONFIGS = (
    Config(seq=4, sequence_parallel=True),
    Config(seq=8, query_heads=8, kv_heads=4, world_size=4, sequence_parallel=True),
    Config(seq=6, batch=1, hidden=8, query_heads=6, kv_heads=3, head_dim=2, world_size=3,
           sequence_parallel=True),
)


def _tensor_list(value, count: int, shape, what: str) -> list[torch.Tensor]:
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise _Wrong(f"your function should return a list of {count} tensors, one per rank "
                     f"({what}).")
    for r, t in enumerate(value):
        _expect_shape(_tensor(t, f"rank {r}'s {what}"), shape, f"rank {r}'s {what}")
    return list(value)


def _near(a: torch.Tensor, b: torch.Tensor, terms: int) -> bool:
    """Equal up to the rounding of a sum of ``terms`` terms of size ~ max |b| (or |a|)."""
    scale = max(a.detach().abs().max().item(), b.detach().abs().max().item(), 1e-30)
    bound = 4 * terms * torch.finfo(b.dtype).eps * scale
    return bool((a.detach() - b.detach()).abs().max() <= bound)


@_exercise("the norm-gradient all-reduce under SP", 12)
def check_norm_grad_reduce(finalize) -> str:
    """Check ``finalize(norm_grads) -> list``: given every simulated rank's gradient of its
    replicated ``norm`` weight after the backward pass (one ``[hidden]`` per rank: the share of
    its own ``S/W`` tokens), what each rank must use for its SGD step. Each rank's steps come
    from the engine's simulated ranks (``tpattn.parallel.simulated``); graded on the five
    measures against dense and on whether the replicas of ``norm`` stay identical."""
    count = 0
    for cfg in SP_CONFIGS:
        w = cfg.world_size
        for seed in EXTRA_SEEDS:
            x0, target = make_inputs(cfg, seed)
            base = init_params(cfg, seed + PARAM_SEED_OFFSET)
            steps = rank_steps(simulated_step(
                shard_params(base, cfg), list(zip(x0.chunk(w), target.chunk(w))), cfg,
                Injection(norm_grad="none"), LR))
            own = [s["grads"]["norm"].clone() for s in steps]
            got = _tensor_list(finalize([g.clone() for g in own]), w, [cfg.hidden],
                               "norm gradient")
            total = sum(own[1:], own[0])
            where = f"for seed {seed}, {_shape(cfg)}"
            for r in range(w):
                if _near(got[r], total, w):
                    continue
                if _near(got[r], total / w, w):
                    raise _Wrong(f"{where}, rank {r} uses the average of the ranks' shares; "
                                 f"each share is a different set of tokens' term of one sum, "
                                 f"so they add up (sum, not mean).")
                if _near(got[r], own[r], 1):
                    raise _Wrong(f"{where}, rank {r} keeps only its own tokens' share: the "
                                 f"norm weight sees S/W tokens per rank, so its gradient "
                                 f"needs an all-reduce (sum) over the TP group.")
                raise _Wrong(f"{where}, rank {r}'s norm gradient is neither the sum of the "
                             f"ranks' shares nor any one of them.")
            for r, s in enumerate(steps):
                s["grads"]["norm"] = got[r].detach()
                s["weights"]["norm"] = sgd_step({"norm": base["norm"]},
                                                {"norm": got[r].detach()}, LR)["norm"]
            metrics = five_measures(seed, EQUIVALENCE, dense_reference(x0, target, base, cfg),
                                    gather_steps(steps, cfg))
            failing = _failing(metrics)
            if failing:
                raise _Wrong(f"{where}, the SP step fails {', '.join(failing)}.")
            count += 1
    return (f"every rank uses the sum of the ranks' shares, so the norm replicas stay "
            f"equal and the SP step equals dense on all five measures for {count} cases "
            f"({len(EXTRA_SEEDS)} seeds × {len(SP_CONFIGS)} shapes, 2 to 4 ranks).")


@_exercise("RoPE positions under SP", 12)
def check_rope_offset(offset) -> str:
    """Check ``offset(cfg, rank) -> int``: the position of the first token rank ``rank``
    holds under SP, the ``offset`` it must pass to ``apply_rope`` when it rotates its own
    tokens' queries or keys. Graded by rotating each rank's tokens with it and comparing with
    the rotation of the whole gathered sequence."""
    from tpattn.block.layers import apply_rope
    from tpattn.parallel.sequence_parallel import rank_tokens
    configs = SP_CONFIGS + (Config(seq=12, query_heads=4, kv_heads=4, world_size=4,
                                   sequence_parallel=True),)
    gen = torch.Generator().manual_seed(12)
    for cfg in configs:
        q = torch.randn(cfg.seq, cfg.batch, cfg.query_heads, cfg.head_dim, generator=gen)
        full = apply_rope(q)
        for rank in range(cfg.world_size):
            got = offset(cfg, rank)
            if isinstance(got, torch.Tensor) and got.numel() == 1:
                got = got.item()
            if isinstance(got, bool) or not isinstance(got, int):
                raise _Wrong(f"your offset should be an int, but it is {type(got).__name__}.")
            tokens = rank_tokens(cfg, rank)
            if not 0 <= got <= 4 * cfg.seq:
                raise _Wrong(f"for {cfg.world_size} ranks, seq {cfg.seq}, rank {rank}: "
                             f"offset {got} is not a position of this sequence.")
            mine = apply_rope(q[tokens], offset=got)
            if not _near(mine, full[tokens], 2):
                first = tokens.start
                hint = (" — that rotates every rank's tokens as if they started the sequence"
                        if got == 0 and first else "")
                raise _Wrong(f"for {cfg.world_size} ranks, seq {cfg.seq}: rank {rank} holds "
                             f"positions {first}..{tokens.stop - 1} of the gathered sequence, "
                             f"but offset {got} rotates them as positions "
                             f"{got}..{got + tokens.stop - first - 1}{hint}.")
    return (f"right for every rank of {len(configs)} shapes (2 to 4 ranks): each rank's "
            f"rotated tokens equal the gathered sequence's, so attention sees global "
            f"positions.")


# --- chapter 13 -----------------------------------------------------------------------------

#: Shapes with fewer KV heads than ranks (replicated KV weights): 2 KV heads on 4 ranks; 1 KV
#: head on 4 ranks; 2 KV heads on 8 ranks (seq 3, batch 1, hidden 8, head_dim 2).
KV_CONFIGS = (
    Config(query_heads=8, kv_heads=2, world_size=4),
    Config(query_heads=4, kv_heads=1, world_size=4),
    Config(seq=3, batch=1, hidden=8, query_heads=8, kv_heads=2, head_dim=2, world_size=8),
)


@_exercise("reduce the KV gradients over the replica group", 13)
def check_kv_grad_reduce(reduce) -> str:
    """Check ``reduce(grads, cfg) -> list``: given every simulated rank's gradient of its own
    copy of a replicated KV weight (``wk`` or ``wv``, one ``[D, hidden]`` per rank, as the
    block's backward leaves it without the replica-group reduce), the gradient each rank's
    copy must get. Graded against the dense block's gradient of that KV head's rows."""
    from tpattn.parallel.kv_heads import kv_weight_rows, replica_groups
    count = 0
    for cfg, seed, x0, target, base in _cases(KV_CONFIGS, EXTRA_SEEDS):
        w = cfg.world_size
        steps = rank_steps(simulated_step(shard_params(base, cfg), [(x0, target)] * w, cfg,
                                          Injection(kv_grad="none"), LR))
        dense = dense_reference(x0, target, base, cfg)
        groups = replica_groups(cfg)
        for name in ("wk", "wv"):
            own = [s["grads"][name].clone() for s in steps]
            rows = own[0].shape[0]
            got = _tensor_list(reduce([g.clone() for g in own], cfg), w,
                               [rows, cfg.hidden], f"{name} gradient")
            everyone = sum(own[1:], own[0])
            where = f"for seed {seed}, {_shape(cfg)}"
            for r in range(w):
                want = dense["grads"][name][kv_weight_rows(cfg, r)]
                group = next(g for g in groups if r in g)
                if _near(got[r], want, w):
                    continue
                in_group = sum(own[i] for i in group)
                if _near(got[r], own[r], 1):
                    raise _Wrong(f"{where}, rank {r}'s copy of {name} keeps only its own "
                                 f"rank's gradient; ranks {group} read the same KV head, so "
                                 f"the head's gradient is the sum over that replica group.")
                if _near(got[r], everyone, w):
                    raise _Wrong(f"{where}, rank {r}'s {name} gradient is summed over all "
                                 f"{w} ranks; the other replica groups hold other KV heads — "
                                 f"sum only over its replica group {group}.")
                if _near(got[r], in_group / len(group), w):
                    raise _Wrong(f"{where}, rank {r}'s {name} gradient is the replica "
                                 f"group's average; each replica's gradient is a different "
                                 f"term of the head's gradient, so they add up.")
                raise _Wrong(f"{where}, rank {r}'s {name} gradient is not the dense "
                             f"gradient of its KV head's rows.")
            count += 1
    return (f"every rank's copy of wk and wv gets its KV head's full gradient (the sum over "
            f"its replica group) on {count} cases: {len(EXTRA_SEEDS)} seeds × "
            f"{len(KV_CONFIGS)} shapes, 4 and 8 ranks.")


@functools.lru_cache(maxsize=None)
def _kv_mode_hits() -> tuple[frozenset, ...]:
    """For every KV shape × seed × simulation of ``missing_kv_grad_reduce``: the parameters
    whose gradients are wrong."""
    from tpattn.check.core import MISSING_KV_GRAD_REDUCE
    found = []
    for cfg, seed, x0, target, base in _cases(KV_CONFIGS[:2], EXTRA_SEEDS):
        dense = dense_reference(x0, target, base, cfg)
        for simulate in SIMULATIONS:
            tp = tp_step(x0, target, base, cfg, resolve(MISSING_KV_GRAD_REDUCE, cfg).injection,
                         simulate)
            found.append(frozenset(
                k for k in PARAM_NAMES
                if max_abs_diff(dense["grads"][k], tp["grads"][k]) >= TOLERANCE))
    return tuple(found)


@_exercise("which parameters a missing KV reduce hits", 13)
def check_missing_kv_parameters(predict) -> str:
    """Check ``predict() -> set``: the names (``tpattn.block.params.PARAM_NAMES``) of the parameters
    whose gradients are wrong when the replica-group all-reduce of the KV gradients is
    missing. Graded against runs of ``missing_kv_grad_reduce``, parameter by parameter."""
    from tpattn.check.core import MISSING_KV_GRAD_REDUCE
    predicted = _as_names(predict(), PARAM_NAMES, "parameter")
    found = [set(hit) for hit in _kv_mode_hits()]
    return _grade_prediction(predicted, found, "parameter gradients", MISSING_KV_GRAD_REDUCE,
                             PARAM_NAMES, shapes=2, seeds=len(EXTRA_SEEDS))


# --- chapter 14 -----------------------------------------------------------------------------

def _bound_configs() -> tuple[Config, ...]:
    from tpattn.check.at_scale import llama3_8b_attention
    return (Config(), Config(dtype="float64"), Config(dtype="bfloat16"),
            Config(seq=7, batch=3, hidden=32, query_heads=8, kv_heads=2, world_size=4),
            llama3_8b_attention(), llama3_8b_attention(dtype="bfloat16"),
            llama3_8b_attention(seq=512, world_size=2))


def _bound_variants(cfg: Config) -> dict[str, float]:
    """The bound with one ingredient wrong, each with what it misses."""
    import math
    from tpattn.check.tolerance import ACCUMULATOR, LATER_STAGES, UNIT_ROUNDOFF, fan_in
    u, n = UNIT_ROUNDOFF[cfg.dtype], fan_in(cfg)
    u_acc = UNIT_ROUNDOFF[ACCUMULATOR[cfg.dtype]]
    w, later = cfg.world_size, LATER_STAGES
    return {
        "the long sums accumulate in the accumulator's precision (float32 for bfloat16), "
        "so their term uses u_acc, not the stored dtype's u":
            u * math.sqrt(n) + u * (w + later),
        "the later stages and the W-term of the sum over ranks round in the stored dtype: "
        "u, not u_acc": u_acc * math.sqrt(n) + u_acc * (w + later),
        "rounding errors of a long sum grow like sqrt(n), not n":
            u_acc * n + u * (w + later),
        "the sum over W ranks' partials adds W roundings": u_acc * math.sqrt(n) + u * later,
        f"the {later} elementwise stages after the reductions each round once":
            u_acc * math.sqrt(n) + u * w,
        "n is the longest dot product of the step: max(hidden, (Hq + 2 Hkv) D, S·B), not "
        "hidden alone": u_acc * math.sqrt(cfg.hidden) + u * (w + later),
    }


@_exercise("the tolerance bound", 14)
def check_relative_bound(bound) -> str:
    """Check ``bound(cfg) -> float``: the relative bound ``rho`` two correct computations of
    the block's step may differ by (``tpattn.check.tolerance``), for shapes from the fixture's to
    Llama-3-8B's attention, in float32, float64 and bfloat16."""
    from tpattn.check.tolerance import relative_bound
    configs = _bound_configs()
    for cfg in configs:
        got = bound(cfg)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise _Wrong(f"your bound should be a float, but it is {type(got).__name__}.")
        want = relative_bound(cfg)
        if abs(got - want) <= 1e-9 * want:
            continue
        why = next((text for text, value in _bound_variants(cfg).items()
                    if abs(got - value) <= 1e-9 * value), None)
        ratio = got / want if want else float("inf")
        raise _Wrong(f"for {_shape(cfg)}, your bound is {ratio:.3g} times the package's"
                     + (f": {why}." if why else "."))
    return (f"right for all {len(configs)} shapes, float32, float64 and bfloat16 among them, "
            f"up to Llama-3-8B's attention: rho = u_acc sqrt(n) + u (W + 4).")


#: The dtypes and shapes ``check_classify`` runs.
CLASSIFY_CONFIGS = (Config(), Config(dtype="float64"), Config(dtype="bfloat16"),
                    Config(query_heads=8, kv_heads=4, world_size=4, dtype="bfloat16"))


@functools.lru_cache(maxsize=None)
def _auto_runs() -> tuple[dict, ...]:
    return tuple((cfg, run(seed, mode, cfg, tolerance="auto"))
                 for cfg, seed in zip(CLASSIFY_CONFIGS, CHECKED_SEEDS + CHECKED_SEEDS)
                 for mode in MODES)


@_exercise("rounding or a bug", 14)
def check_classify(classify) -> str:
    """Check ``classify(result) -> str``: ``"rounding"`` when a run's measures are within
    what rounding explains, ``"bug"`` when they are not, for a ``tpattn.run(...,
    tolerance="auto")`` dict (its measures and its ``"bounds"``). Graded on real runs of every
    mode in float32, float64 and bfloat16: correct TP is rounding, every bug a bug."""
    cases = [(cfg, dict(r, bounds=dict(r["bounds"]))) for cfg, r in _auto_runs()]
    for cfg, result in cases:
        want = "rounding" if resolve(result["mode"]).is_correct else "bug"
        got = classify({k: v for k, v in result.items()
                        if k not in ("passed", "mode", "verdict", "reason", "floors",
                                     "amplification")})
        if got not in ("rounding", "bug"):
            raise _Wrong(f"your function should return 'rounding' or 'bug', but it gave "
                         f"{got!r}.")
        if got != want:
            dtype = cfg.dtype
            over = [m for m in MEASURES if result[m] > result["bounds"][m]]
            if want == "rounding":
                raise _Wrong(f"correct TP (seed {result['seed']}, {dtype}) "
                             f"is rounding: every measure is within its bound, even where "
                             f"it is above the seed's fixed 1e-6 — the bound scales with "
                             f"the dtype and the size.")
            raise _Wrong(f"{result['mode']} (seed {result['seed']}, {dtype}) "
                         f"is a bug: {', '.join(over)} exceed{'s' if len(over) == 1 else ''} "
                         f"{'its bound' if len(over) == 1 else 'their bounds'}; any one "
                         f"measure over its bound is enough.")
    return (f"right on {len(cases)} runs: every mode, {len(CHECKED_SEEDS)} seeds, "
            f"float32, float64 and bfloat16 — correct TP within its bounds, every bug over "
            f"at least one.")


# --- chapter 15 -----------------------------------------------------------------------------

def _block_source(block: torch.Tensor, params: dict, d: int) -> str:
    """Which dense head ``block`` (``d`` rows) is, in words: 'query head 2', or '' if none."""
    for name, what in (("wq", "query head"), ("wk", "key head"), ("wv", "value head")):
        h = _head_of(block.detach(), params[name].detach(), d)
        if h is not None:
            return f"{what} {h}"
    return ""


#: Shapes the fused-QKV exercises read the heads on: two KV groups per rank among them.
FUSED_CONFIGS = CHECKED_CONFIGS + (Config(query_heads=8, kv_heads=4),)


def _grade_fused(shard, fuse, layout: str) -> str:
    """Run the reader's ``shard(w, cfg)`` on the fused weight ``fuse(params, cfg)``: which
    head every rank's rows are, then chapter 6's checks of the shards on every checked case;
    returns the success text."""
    want_kind = {"wq": "query head", "wk": "key head", "wv": "value head"}
    for cfg in FUSED_CONFIGS:
        d = cfg.head_dim
        base = clone_trainable(init_params(cfg, 11 + PARAM_SEED_OFFSET))
        shards = shard(fuse(base, cfg), cfg)
        if not isinstance(shards, (list, tuple)) or len(shards) != cfg.world_size:
            raise _Wrong(f"for {_shape(cfg)} your function should return a list of "
                         f"{cfg.world_size} dicts, one per rank.")
        for rank, mine in enumerate(shards):
            if not isinstance(mine, dict) or any(k not in mine for k in ("wq", "wk", "wv")):
                raise _Wrong(f"rank {rank}'s shard should be a dict with the keys wq, wk, wv.")
            rows = {"wq": cfg.local_query_heads * d, "wk": cfg.local_kv_heads * d,
                    "wv": cfg.local_kv_heads * d}
            for name, count in rows.items():
                t = _tensor(mine[name], f"rank {rank}'s {name}")
                _expect_shape(t, [count, cfg.hidden], f"for {_shape(cfg)}, rank {rank}'s {name}")
                for i in range(count // d):
                    source = _block_source(t[i * d:(i + 1) * d], base, d)
                    if not source.startswith(want_kind[name]):
                        raise _Wrong(f"for {_shape(cfg)}, rank {rank}'s {name} rows "
                                     f"{i * d}..{(i + 1) * d - 1} are "
                                     f"{source or 'no whole head'} of the {layout} weight, not "
                                     f"a {want_kind[name]}: read the fused rows by the "
                                     f"layout, then cut by heads.")

    def shard_fn(params, cfg):
        cut = shard(fuse(params, cfg), cfg)
        return [{"norm": params["norm"], "wq": cut[r]["wq"], "wk": cut[r]["wk"],
                 "wv": cut[r]["wv"],
                 "wo": params["wo"][:, rank_head_slices(cfg, r)[0]]}
                for r in range(cfg.world_size)]

    try:
        check_shard_params.__wrapped__(shard_fn)
    except _Wrong as e:
        raise _Wrong(f"with the wo columns of chapter 6, {e}") from None
    return (f"every rank's rows are its own heads on {len(FUSED_CONFIGS)} shapes (two KV "
            f"groups per rank among them), gradients reach the dense parameters, and with "
            f"chapter 6's wo columns the sharded block passes all five measures for "
            f"{len(CHECKED_SEEDS)} seeds × {len(CHECKED_CONFIGS)} shapes.")


@_exercise("shard a concatenated [Wq; Wk; Wv] weight", 15)
def check_shard_concat_qkv(shard) -> str:
    """Check ``shard(w, cfg) -> list[dict]``: every rank's ``wq``, ``wk``, ``wv`` rows cut
    from a fused checkpoint weight ``w = [Wq; Wk; Wv]`` (``[(Hq + 2 Hkv) D, hidden]``,
    ``tpattn.interop.concat_qkv``), differentiably. Graded by the heads each rank holds and
    by the five measures of the sharded block (chapter 6's checks)."""
    def fuse(params, cfg):
        return torch.cat([params["wq"], params["wk"], params["wv"]])

    return _grade_fused(shard, fuse, "concatenated")


@_exercise("shard Megatron's interleaved QKV weight", 15)
def check_shard_fused_qkv(shard) -> str:
    """Check ``shard(w, cfg) -> list[dict]``: every rank's ``wq``, ``wk``, ``wv`` rows cut
    from Megatron's fused weight (``tpattn.interop.fuse_qkv``: per KV group its query heads,
    its key head, its value head), differentiably. Graded as ``check_shard_concat_qkv``."""
    from tpattn.interop import fuse_qkv

    def fuse(params, cfg):
        return fuse_qkv(params["wq"], params["wk"], params["wv"], cfg)

    return _grade_fused(shard, fuse, "interleaved")


# --- chapter 16 -----------------------------------------------------------------------------

@_exercise("add the row-parallel bias once", 16)
def check_bias_once(forward) -> str:
    """Check ``forward(x, p, cfg) -> [S, B, hidden]``: the sharded block (the fixture's one
    process, as ``tpattn.parallel.tp.tp_forward``) with the output projection's bias ``p["bias"]``
    (``[hidden]``, replicated) — the fix of ``row_bias_on_every_rank``. Graded on the five
    measures against the dense block with its bias (``tpattn.bugs.zoo``)."""
    from tpattn.bugs import zoo
    from tpattn.check.core import one_step
    inj = zoo.Injection(bias="after_g")
    for cfg in CHECKED_CONFIGS:
        for seed in EXTRA_SEEDS:
            x0, target = make_inputs(cfg, seed)
            base = zoo.make_params(cfg, seed, inj)
            dense = zoo.dense_step(x0, target, base, cfg, inj)
            where = f"for seed {seed}, {_shape(cfg)}"
            b = base["bias"]
            w = cfg.world_size
            trial = clone_trainable(base)
            out = _tensor(forward(x0.clone(), trial, cfg), "your output")
            off = out.detach() - dense["output"]
            _expect_shape(off, dense["output"].shape, f"for {_shape(cfg)} your output")
            if _near(off, ((w - 1) * b).expand_as(off), w + 2):
                raise _Wrong(f"{where} the output is off by (W-1)·b: the bias is added on "
                             f"every rank before g sums the partials — add it once, after "
                             f"the sum.")
            if _near(off, (-b).expand_as(off), w + 2):
                raise _Wrong(f"{where} the output lacks the bias: add p['bias'] once, after "
                             f"g.")
            if out.requires_grad:
                out.sum().backward()
            unreached = [k for k, t in trial.items() if t.grad is None]
            if unreached:
                raise _Wrong(f"{where} the output is right but the gradients do not reach "
                             f"{', '.join(unreached)}: use the parameters of p themselves "
                             f"(no detach, no copy).")
            tp = one_step(lambda x, p: forward(x, p, cfg), x0, target, base)
            _expect_shape(_tensor(tp["output"], "your output"), dense["output"].shape,
                          f"for {_shape(cfg)} your output")
            metrics = five_measures(seed, EQUIVALENCE, dense, tp)
            failing = _failing(metrics)
            if not failing:
                continue
            if "forward_max_abs_diff" not in failing:
                raise _Wrong(f"{where} the output is right but {', '.join(failing)} fail: "
                             f"the bias must be the parameter p['bias'] itself, so its "
                             f"gradient reaches it.")
            raise _Wrong(f"{where} the sharded block fails {', '.join(failing)}.")
    return (f"the bias is added once, after the all-reduce: the block equals dense with its "
            f"bias on all five measures for {len(EXTRA_SEEDS)} seeds × "
            f"{len(CHECKED_CONFIGS)} shapes.")


@functools.lru_cache(maxsize=None)
def _zoo_forward_hits() -> tuple[tuple[str, Config, int, bool], ...]:
    """For every runnable registry bug on both hunt shapes (a seed each): whether rank 0's
    forward output (``tpattn.bugs.zoo.forward_fixture``, the fixture's view, as ``tpattn.run``
    runs it) differs from the dense block's by ``TOLERANCE`` or more. Forward only: the
    forward measure needs no backward."""
    from tpattn.bugs import zoo
    from tpattn.diagnosis.hunt import HUNT_SHAPES
    found = []
    for mode in zoo.runnable_modes():
        if zoo.get_mode(mode).is_correct:  # correct TP: no bug to hit
            continue
        inj = zoo.get_mode(mode).injection
        for cfg, seed in zip(HUNT_SHAPES, EXTRA_SEEDS):
            x0, _ = make_inputs(cfg, seed)
            base = zoo.make_params(cfg, seed, inj)
            xs = [x0] * cfg.world_size
            if inj.inputs == "per_rank":
                xs = [x0] + [b[0] for b in zoo.rank_batches(cfg, seed, inj)[1:]]
            with torch.no_grad():
                dense = dense_forward(x0, base, cfg) + base.get("bias", 0)
                hit = max_abs_diff(dense, zoo.forward_fixture(xs, base, cfg, inj)) >= TOLERANCE
            found.append((mode, cfg, seed, hit))
    return tuple(found)


@_exercise("which zoo bugs the forward shows", 16)
def check_forward_visible(predict) -> str:
    """Check ``predict() -> set``: the names of the zoo's bugs (``tpattn.bugs.zoo.runnable_modes``,
    without ``equivalence``) whose forward output differs from dense's
    (``forward_max_abs_diff`` fails, rank 0's view). Graded on the zoo's block with each
    bug injected, on both hunt shapes."""
    from tpattn.bugs import zoo
    names = [m for m in zoo.runnable_modes() if not zoo.get_mode(m).is_correct]
    predicted = _as_names(predict(), names, "zoo bug")
    runs = _zoo_forward_hits()
    for mode in names:
        hits = {hit for m, _, _, hit in runs if m == mode}
        if len(hits) != 1:  # pragma: no cover - not seen in the package so far
            raise _Wrong(f"the shapes disagree on whether {mode}'s forward is wrong.")
        if (mode in predicted) != hits.pop():
            if mode in predicted:
                raise _Wrong(f"you named {mode}, but its forward output equals dense's on "
                             f"both shapes: it shows only in the backward pass or the "
                             f"step.")
            raise _Wrong(f"you left out {mode}: its forward output differs from dense's "
                         f"on both shapes.")
    return (f"right on all {len(names)} zoo bugs, each run on 2 shapes and seeds: exactly "
            f"the ones you named change the forward output.")


# --- chapter 18 -----------------------------------------------------------------------------

#: The registry bugs that change what the ledger records, by construction of their injection.
_LEDGER_BUGS = (MISSING_OUTPUT_REDUCE, "output_reduced_twice", MISSING_INPUT_GRAD_REDUCE,
                "input_grad_reduced_twice")


@functools.lru_cache(maxsize=None)
def _observed(mode: str, seed: int, cfg: Config, reference: bool, steps: int = 2) -> dict:
    from tpattn.diagnosis.observe import observe
    return observe(mode, seed, cfg, steps=steps, reference=reference)


@_exercise("read the ledger", 18)
def check_ledger_verdict(verdict) -> str:
    """Check ``verdict(obs) -> str | None``: from the ledger alone (``obs["ledger"]`` against
    ``obs["planned_ledger"]``, as ``tpattn.diagnosis.observe.observe`` records them), the bug a run's
    collectives show — ``missing_output_reduce``, ``output_reduced_twice``,
    ``missing_input_grad_reduce``, ``input_grad_reduced_twice`` — or ``None`` when the ledger
    is as planned. Graded on observed runs of every runnable zoo mode."""
    import copy
    from tpattn.bugs import zoo
    from tpattn.diagnosis.hunt import HUNT_SHAPES
    modes = zoo.runnable_modes()
    for mode in modes:
        for cfg, seed in zip(HUNT_SHAPES, EXTRA_SEEDS):
            if mode not in _LEDGER_BUGS and cfg is not HUNT_SHAPES[0]:
                continue  # the counts of these are the plan's on every shape
            obs = _observed(mode, seed, cfg, False, 1)
            got = verdict(copy.deepcopy(obs))
            want = mode if mode in _LEDGER_BUGS else None
            if got == want:
                continue
            if got is not None and got not in _LEDGER_BUGS:
                raise _Wrong(f"your function returned {got!r}; return one of "
                             f"{', '.join(_LEDGER_BUGS)}, or None.")
            counts = {phase: sum(e["phase"] == phase for e in obs["ledger"])
                      for phase in ("forward", "backward")}
            plan = {phase: sum(e["phase"] == phase for e in obs["planned_ledger"])
                    for phase in ("forward", "backward")}
            shown = (f"forward {counts['forward']} (plan {plan['forward']}), backward "
                     f"{counts['backward']} (plan {plan['backward']})")
            if want is None:
                correct = zoo.get_mode(mode).is_correct
                run_of = "a correct run" if correct else f"a run of {mode}"
                raise _Wrong(f"for {run_of} the ledger shows {shown} — as planned — but "
                             f"you said {got}: "
                             + ("" if correct else "this bug leaves the "
                                "collectives alone; ") + "answer None.")
            phase = "forward" if counts["forward"] != plan["forward"] else "backward"
            fewer = counts[phase] < plan[phase]
            raise _Wrong(f"the ledger shows {shown}, and you said {got}: one all-reduce "
                         f"{'fewer' if fewer else 'more'} in the {phase} pass is {want}.")
    return (f"right on observed runs of all {len(modes)} runnable zoo modes (two shapes for "
            f"the four the ledger shows): a count below the plan is a missing reduce, above "
            f"it a doubled one, and the other bugs leave the counts as planned (an averaged f "
            f"changes only its op, to avg).")


#: The hunts of ``check_hunts`` (``tpattn.diagnosis.hunt.hunt_case``): a clipping bug, a bias bug,
#: diverged data and a run with no bug.
HUNTS = (0, 3, 10, 1)


@_exercise("three bug hunts and a healthy run", 18)
def check_hunts(guess) -> str:
    """Check ``guess(hunt) -> str``: for each hunt of ``HUNTS``, the cause of the run
    ``tpattn.diagnosis.hunt.hunt_case(hunt)`` hides, named from its observables alone: a registry
    bug's name or ``tpattn.diagnosis.diagnose.NO_KNOWN_CAUSE``. Judged by ``tpattn.diagnosis.hunt.judge``."""
    from tpattn.diagnosis.hunt import choices, hunt_case, judge
    for hunt in HUNTS:
        answer = guess(hunt)
        if answer not in choices():
            raise _Wrong(f"for hunt {hunt} you said {answer!r}; name a registry bug or "
                         f"NO_KNOWN_CAUSE ({', '.join(choices())}).")
        mode, seed, cfg = hunt_case(hunt)
        right, why = judge(_observed(mode, seed, cfg, True), mode, answer)
        if not right:
            raise _Wrong(f"hunt {hunt}: {why}")
    return (f"right on all {len(HUNTS)} hunts, the healthy run among them: each cause "
            f"named from the observables alone, no dense model.")


def hunt_evidence(hunt: int) -> list[str]:
    """What hunt ``hunt``'s run shows, in words (``tpattn.diagnosis.hunt.describe`` of the same
    observation ``check_hunts`` judges), without naming the hidden cause."""
    from tpattn.diagnosis.hunt import describe, hunt_case
    mode, seed, cfg = hunt_case(hunt)
    return describe(_observed(mode, seed, cfg, True))


# =============================================================================================
# --- chapter 17, around the block: dropout (Megatron's RNG discipline) and qk-norm ---------

#: The chapter "Around the block".
AROUND_CHAPTER = 17
__all__ += ["check_dropout_streams", "check_rng_resync", "check_qk_norm_grad_reduce",
            "check_qk_norm_hits"]

#: Shapes the dropout exercises are graded on: the seed's with p = 0.1; 4 ranks with 2 query
#: heads each, p = 0.2; a small odd one (3 tokens, batch 1, hidden 8, heads of 2), p = 0.3.
DROPOUT_CONFIGS = (
    Config(dropout=0.1),
    Config(query_heads=8, kv_heads=4, world_size=4, dropout=0.2),
    Config(seq=3, batch=1, hidden=8, query_heads=6, kv_heads=2, head_dim=2, dropout=0.3),
)
#: The same shapes with qk-norm on (no dropout).
QK_NORM_CONFIGS = tuple(Config(**{**c.as_dict(), "dropout": 0.0, "qk_norm": True})
                        for c in DROPOUT_CONFIGS)


def _model_cases(configs, seeds=EXTRA_SEEDS):
    """``(cfg, seed, x0, target, base)`` with the option's parameters (``make_params``)."""
    from tpattn.check.core import make_params
    for cfg in configs:
        for seed in seeds:
            x0, target = make_inputs(cfg, seed)
            yield cfg, seed, x0, target, make_params(cfg, seed, Injection())


def _stream_seed(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Wrong(f"the {what} seed should be an int, but it is {type(value).__name__}.")
    return value


@_exercise("dropout's two random streams", AROUND_CHAPTER)
def check_dropout_streams(seeds) -> str:
    """Check ``seeds(seed, tp_rank) -> {"residual": int, "attention": int}``: the seeds of the
    generators TP rank ``tp_rank`` draws its residual-dropout mask (outside the sharded region)
    and its attention-dropout masks (its own heads) from. The ranks' steps run on the engine's
    simulated ranks with those generators; graded on the five measures against the dense block
    with the masks they draw, and on whether each rank's heads get their own stream."""
    from tpattn.parallel.rng import RankStreams
    count = 0
    for cfg, seed, x0, target, base in _model_cases(DROPOUT_CONFIGS):
        w = cfg.world_size
        where = f"for seed {seed}, {_shape(cfg)}"
        drawn = []
        for r in range(w):
            got = seeds(seed, r)
            if not isinstance(got, dict) or set(got) != {"residual", "attention"}:
                raise _Wrong("your function should return a dict with the keys 'residual' "
                             "and 'attention'.")
            drawn.append({k: _stream_seed(v, k) for k, v in got.items()})
        residual = [d["residual"] for d in drawn]
        attention = [d["attention"] for d in drawn]
        if len(set(attention)) < w:
            raise _Wrong(f"{where}, two ranks draw their attention masks from the same seed: "
                         f"their heads are different heads, so each rank needs its own "
                         f"stream inside the sharded region (Megatron: seed + 2718 + "
                         f"tp_rank).")
        if set(attention) & set(residual):
            raise _Wrong(f"{where}, an attention stream has the residual stream's seed: the "
                         f"two draw different masks and must not replay each other.")

        def streams():
            return RankStreams([torch.Generator().manual_seed(s) for s in residual],
                               [torch.Generator().manual_seed(s) for s in attention])
        reference = streams()  # the masks the ranks draw, assembled for the dense block
        masks = {"attention": reference.attention_masks(cfg),
                 "residual": reference.residual_masks(cfg)[0]}
        step = simulated_step(shard_params(base, cfg), [(x0, target)] * w, cfg, Injection(),
                              LR, rng=streams())
        metrics = five_measures(seed, EQUIVALENCE,
                                dense_reference(x0, target, base, cfg, masks),
                                rank0_view(step, cfg))
        failing = _failing(metrics)
        if failing:
            if len(set(residual)) > 1:
                raise _Wrong(f"{where}, the ranks draw their residual masks from different "
                             f"seeds: every rank holds the whole output after g, so the "
                             f"ranks drop different elements of one replicated tensor and "
                             f"the step fails {', '.join(failing)}.")
            raise _Wrong(f"{where}, the step fails {', '.join(failing)}.")
        count += 1
    return (f"the residual stream is the same on every rank and each rank's heads have their "
            f"own: the step equals dense on all five measures for {count} cases "
            f"({len(EXTRA_SEEDS)} seeds × {len(DROPOUT_CONFIGS)} shapes, 2 and 4 ranks).")


def _state_list(value, states: list[torch.Tensor]) -> list[torch.Tensor]:
    if not isinstance(value, (list, tuple)) or len(value) != len(states):
        raise _Wrong(f"your function should return a list of {len(states)} generator "
                     f"states, one per rank.")
    for r, t in enumerate(value):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 \
                or t.shape != states[0].shape:
            raise _Wrong(f"rank {r}'s state should be a generator state like the ones you "
                         f"got (a uint8 tensor of {states[0].numel()} bytes).")
    return list(value)


@_exercise("re-sync the drifted RNG", AROUND_CHAPTER)
def check_rng_resync(resync) -> str:
    """Check ``resync(states) -> list``: given every TP rank's default-generator state
    (``torch.Generator.get_state()``, a uint8 tensor) after tp_rank 0's data loader drew its
    workers' base seed from it, the state each rank must continue with. Graded by running the
    step with those states: every rank's output, loss and norm weight must agree."""
    from tpattn.parallel.rng import simulated_streams
    count = 0
    for cfg, seed, x0, target, base in _model_cases(DROPOUT_CONFIGS):
        w = cfg.world_size
        where = f"for seed {seed}, {_shape(cfg)}"
        streams = simulated_streams(cfg, seed, Injection(rng="rank0_drift"))
        states = [g.get_state() for g in streams.defaults]
        got = _state_list(resync([s.clone() for s in states]), states)
        if not any(torch.equal(got[0], s) for s in states):
            raise _Wrong(f"{where}, rank 0's state is none the ranks had: keep one rank's "
                         f"stream (broadcast it), do not make up a new one.")
        for g, s in zip(streams.defaults, got):
            g.set_state(s.clone())
        step = simulated_step(shard_params(base, cfg), [(x0, target)] * w, cfg, Injection(),
                              LR, rng=streams)
        apart = max(max_abs_diff(step["outputs"][r], step["outputs"][0]) for r in range(w))
        if apart > 0:
            same = all(torch.equal(a, b) for a, b in zip(got, states))
            raise _Wrong(f"{where}, the ranks' outputs still differ by {apart:.2g}"
                         + (": the states are the drifted ones, unchanged" if same else
                            ": the ranks continue from different states")
                         + "; every TP rank must draw the residual mask from one state.")
        if len(set(step["losses"].tolist())) != 1:
            raise _Wrong(f"{where}, the ranks' losses differ.")
        count += 1
    return (f"every TP rank continues from one state: the residual masks, the outputs and "
            f"the losses agree on all ranks for {count} cases ({len(EXTRA_SEEDS)} seeds × "
            f"{len(DROPOUT_CONFIGS)} shapes). Megatron-DeepSpeed PR 276 removed the drift "
            f"instead: the loader got its own generator.")


@_exercise("reduce the q/k-norm gradients", AROUND_CHAPTER)
def check_qk_norm_grad_reduce(reduce) -> str:
    """Check ``reduce(grads) -> list``: given every TP rank's gradient of its copy of
    ``q_norm`` (or ``k_norm``) after backward (one ``[head_dim]`` per rank: the part of its
    own heads), the gradient each rank must step with. Run in the engine's train step on
    simulated ranks; graded on the five measures against dense and on whether the replicas
    stay identical."""
    from tpattn.parallel.collectives import SimulatedRanks
    from tpattn.parallel.engine import train_step

    class ReaderReduce(SimulatedRanks):
        def reduce_qk_norm_grads(self, gq, gk):
            out = []
            for name, g in (("q_norm", gq), ("k_norm", gk)):
                own = [t.clone() for t in g.unbind(0)]
                got = _tensor_list(reduce([t.clone() for t in own]), g.shape[0],
                                   [g.shape[1]], f"{name} gradient")
                self.seen.append((name, own, got))
                out.append(torch.stack([t.detach() for t in got]))
            return tuple(out)

    count = 0
    for cfg, seed, x0, target, base in _model_cases(QK_NORM_CONFIGS):
        w = cfg.world_size
        where = f"for seed {seed}, {_shape(cfg)}"
        comm = ReaderReduce(cfg, [])
        comm.seen = []
        shards = shard_params(base, cfg)
        stacked = {k: torch.stack([s[k] for s in shards]) for k in shards[0]}
        x = torch.stack([x0] * w)
        step = train_step(stacked, x, torch.stack([target] * w), cfg, Injection(), comm, LR)
        for name, own, got in comm.seen:
            total = sum(own[1:], own[0])
            for r in range(w):
                if _near(got[r], total, w):
                    continue
                if _near(got[r], total / w, w):
                    raise _Wrong(f"{where}, rank {r}'s {name} gradient is the ranks' average: "
                                 f"each rank's part covers different heads, so they add up.")
                if _near(got[r], own[r], 1):
                    raise _Wrong(f"{where}, rank {r} keeps only its own heads' part of the "
                                 f"{name} gradient: the weight is replicated, its gradient "
                                 f"needs the TP all-reduce (sum) after backward.")
                raise _Wrong(f"{where}, rank {r}'s {name} gradient is not the sum of the "
                             f"ranks' parts.")
        apart = max(max_abs_diff(step["weights"][k][r], step["weights"][k][0])
                    for k in ("q_norm", "k_norm") for r in range(w))
        if apart > 0:
            raise _Wrong(f"{where}, the q/k-norm replicas differ by {apart:.2g} after the step.")
        metrics = five_measures(seed, EQUIVALENCE, dense_reference(x0, target, base, cfg),
                                rank0_view(step, cfg))
        failing = _failing(metrics)
        if failing:
            raise _Wrong(f"{where}, the step fails {', '.join(failing)}.")
        count += 1
    return (f"every rank steps with the sum of the ranks' parts: the q/k-norm replicas stay "
            f"identical and the step equals dense on all five measures for {count} cases "
            f"({len(EXTRA_SEEDS)} seeds × {len(QK_NORM_CONFIGS)} shapes, 2 and 4 ranks).")


@functools.lru_cache(maxsize=None)
def _qk_norm_mode_hits() -> tuple[frozenset, ...]:
    """For every qk-norm shape × seed × simulation of ``qk_norm_grad_not_reduced``: the
    parameters whose gradients (as rank 0 reports them) are wrong."""
    from tpattn.block.params import QK_NORM_NAMES
    found = []
    inj = resolve("qk_norm_grad_not_reduced", QK_NORM_CONFIGS[0]).injection
    for cfg, seed, x0, target, base in _model_cases(QK_NORM_CONFIGS[:2]):
        dense = dense_reference(x0, target, base, cfg)
        for simulate in SIMULATIONS:
            tp = tp_step(x0, target, base, cfg, inj, simulate, rng_seed=seed)
            found.append(frozenset(
                k for k in PARAM_NAMES + QK_NORM_NAMES
                if max_abs_diff(dense["grads"][k], tp["grads"][k]) >= TOLERANCE))
    return tuple(found)


@_exercise("which parameters the missing q/k-norm reduce hits", AROUND_CHAPTER)
def check_qk_norm_hits(predict) -> str:
    """Check ``predict() -> set``: the names (``PARAM_NAMES`` and ``q_norm``, ``k_norm``) of
    the parameters whose gradients, as rank 0 reports them, are wrong when the TP all-reduce
    of the q/k-norm gradients is skipped. Graded against runs of
    ``qk_norm_grad_not_reduced``, parameter by parameter."""
    from tpattn.block.params import QK_NORM_NAMES
    names = PARAM_NAMES + QK_NORM_NAMES
    predicted = _as_names(predict(), names, "parameter")
    found = [set(hit) for hit in _qk_norm_mode_hits()]
    return _grade_prediction(predicted, found, "parameter gradients",
                             "qk_norm_grad_not_reduced", names, shapes=2,
                             seeds=len(EXTRA_SEEDS))


# --- chapter 17, around the block: the TP x DP mesh and the sequence gather's group ----------

#: Meshes the mesh exercises are graded on: TP 2 x DP 2; TP 4 x DP 2; TP 2 x DP 3 (batch 1);
#: and TP 2 x DP 2 under sequence parallelism.
MESH_CONFIGS = (
    Config(data_parallel=2),
    Config(query_heads=8, kv_heads=4, world_size=4, data_parallel=2, seq=4),
    Config(seq=3, batch=1, hidden=8, query_heads=6, kv_heads=2, head_dim=2, data_parallel=3),
    Config(data_parallel=2, sequence_parallel=True, seq=4),
)
#: Meshes the SP-group exercises are graded on (``data_parallel == world_size``, as the bug
#: needs, and one where they differ).
SP_MESH_CONFIGS = (
    Config(data_parallel=2, sequence_parallel=True, seq=4),
    Config(query_heads=8, kv_heads=4, world_size=4, data_parallel=4, sequence_parallel=True,
           seq=8, batch=1),
    Config(data_parallel=3, sequence_parallel=True, seq=4, batch=1),
)
__all__ += ["AROUND_CHAPTER", "MESH_CONFIGS", "SP_MESH_CONFIGS", "check_dp_grad_sync",
            "check_logged_loss", "check_sp_gather_group", "check_sp_gather_tokens"]


def _mesh_shape(cfg: Config) -> str:
    return (f"TP {cfg.world_size} x DP {cfg.data_parallel}"
            + (" with sequence parallelism" if cfg.sequence_parallel else ""))


def _mesh_step(cfg: Config, seed: int, inj: Injection) -> dict:
    """A simulated step of the whole mesh (``simulated_step``) of ``inj``'s program."""
    from tpattn.check.core import block_inputs, make_params, rank_batches, shard

    base = make_params(cfg, seed, inj)
    return simulated_step(shard(base, cfg, inj) * cfg.data_parallel,
                          block_inputs(rank_batches(cfg, seed, inj), cfg), cfg, inj, LR)


@_exercise("the data-parallel gradient sync", AROUND_CHAPTER)
def check_dp_grad_sync(sync) -> str:
    """Check ``sync(grads) -> list``: given one parameter's gradient on each DP replica (a
    list of ``data_parallel`` tensors of one shape: each replica's own batch's share of the
    gradient of the global mean loss), what every replica must use for its SGD step (one
    tensor per replica). Graded on the weights after one step of the whole mesh against the
    dense step on the global batch (``MESH_CONFIGS`` x ``EXTRA_SEEDS``)."""
    from tpattn.check.core import dense_step, make_inputs as inputs, make_params, unshard
    from tpattn.parallel.simulated import mesh_view

    count = 0
    for cfg in MESH_CONFIGS:
        w, d = cfg.world_size, cfg.data_parallel
        for seed in EXTRA_SEEDS:
            step = _mesh_step(cfg, seed, Injection(dp_grad="self"))
            where = f"for seed {seed} on {_mesh_shape(cfg)}"
            for name, g in step["grads"].items():
                for t in range(w):
                    own = [g[r * w + t].clone() for r in range(d)]
                    got = _tensor_list(sync([x.clone() for x in own]), d, list(own[0].shape),
                                       f"the synced gradient of {name}")
                    total = sum(own[1:], own[0])
                    for r in range(d):
                        if _near(got[r], total, d):
                            g[r * w + t] = got[r].detach()
                            continue
                        if _near(got[r], total / d, d):
                            raise _Wrong(f"{where}, replica {r} uses the mean of the replicas' "
                                         f"{name} gradients: each share is already divided by "
                                         f"the global numel (the loss is the global mean), so "
                                         f"they add up (SUM over the DP group).")
                        if _near(got[r], own[r], 1):
                            raise _Wrong(f"{where}, replica {r} keeps its own {name} gradient "
                                         f"(a sync over a group of one rank): the replicas "
                                         f"step on different gradients and drift apart.")
                        raise _Wrong(f"{where}, replica {r}'s {name} gradient is neither the "
                                     f"sum of the replicas' nor any one of them.")
            base = make_params(cfg, seed, Injection())
            start = _mesh_shards(cfg, base)  # every rank's step from its synced gradient
            step["weights"] = {name: torch.stack([
                sgd_step({name: start[i][name]}, {name: g[i]}, LR)[name]
                for i in range(cfg.ranks)]) for name, g in step["grads"].items()}
            x0, target = inputs(cfg, seed)
            view = mesh_view(step, cfg, lambda per_rank: unshard(per_rank, cfg, Injection()))
            metrics = five_measures(seed, EQUIVALENCE,
                                    dense_step(x0, target, base, cfg, Injection()), view)
            failing = _failing(metrics)
            if failing:
                raise _Wrong(f"{where}, the mesh's step fails {', '.join(failing)}.")
            count += 1
    return (f"every replica steps on the sum of the replicas' gradients, so the replicas "
            f"stay identical and the mesh equals dense on all five measures for {count} cases "
            f"({len(EXTRA_SEEDS)} seeds x {len(MESH_CONFIGS)} meshes, SP among them).")


def _mesh_shards(cfg: Config, base: dict) -> list[dict]:
    """Every rank's starting shards on the mesh, mesh order."""
    return shard_params(base, cfg) * cfg.data_parallel


@_exercise("the logged loss of a TP x DP mesh", AROUND_CHAPTER)
def check_logged_loss(logged) -> str:
    """Check ``logged(shares, cfg) -> float``: given every rank's share of the global mean
    loss (a list of ``cfg.ranks`` floats in mesh order, global rank = dp * W + tp; without
    sequence parallelism every TP rank of a replica holds that replica's whole share, under
    it each rank its own tokens'), the loss the job must log: the dense loss on the global
    batch, within 1e-6 relative."""
    from tpattn.check.core import (block_inputs, dense_step, make_inputs as inputs,
                                   make_params, rank_batches)

    count = 0
    for cfg in MESH_CONFIGS:
        w, d = cfg.world_size, cfg.data_parallel
        for seed in EXTRA_SEEDS:
            step = _mesh_step(cfg, seed, Injection())
            x0, target = inputs(cfg, seed)
            batches = block_inputs(rank_batches(cfg, seed, Injection()), cfg)
            numel = cfg.seq * cfg.batch * d * cfg.hidden
            shares = [float((y.double() - t.double()).pow(2).sum() / numel)
                      for y, (_, t) in zip(step["outputs"], batches)]
            true = float(dense_step(x0, target, make_params(cfg, seed, Injection()), cfg,
                                    Injection())["loss"])
            got = logged(list(shares), cfg)
            if isinstance(got, torch.Tensor):
                got = float(got)
            if isinstance(got, bool) or not isinstance(got, (int, float)):
                raise _Wrong(f"your function returned {type(got).__name__}; return a float.")
            where = f"for seed {seed} on {_mesh_shape(cfg)}"
            if abs(got - true) <= 1e-6 * abs(true):
                count += 1
                continue
            if abs(got - w * true) <= 1e-5 * w * abs(true) and not cfg.sequence_parallel:
                raise _Wrong(f"{where}, you logged W = {w} times the loss: summing every rank "
                             f"of the mesh counts each replica's share once per TP rank (the "
                             f"loss all-reduced over the world mesh, pytorch/torchtitan PR "
                             f"105); sum over the DP group only.")
            own = sum(shares[:w]) if cfg.sequence_parallel else shares[0]
            if abs(got - own) <= 1e-5 * abs(own):
                raise _Wrong(f"{where}, you logged replica 0's own share, about 1/{d} of the "
                             f"loss: the DP reduction was skipped (a Replicate DTensor's "
                             f"full_tensor() on the TP mesh, pytorch/torchtitan issue 3280).")
            raise _Wrong(f"{where}, you logged {got:.6g}; the global mean loss is {true:.6g}.")
    return (f"the logged loss equals the dense loss on the global batch for {count} cases "
            f"({len(EXTRA_SEEDS)} seeds x {len(MESH_CONFIGS)} meshes): one share per replica "
            f"(per rank under SP), summed over the DP group.")


@_exercise("the group of the sequence all-gather", AROUND_CHAPTER)
def check_sp_gather_group(group_of) -> str:
    """Check ``group_of(rank, cfg) -> list``: the global ranks, in order, that the sequence
    all-gather of global rank ``rank`` runs over on a TP x DP mesh (global rank = dp * W +
    tp): its own TP group. Graded on every rank of ``SP_MESH_CONFIGS``."""
    from tpattn.parallel.collectives import SimulatedRanks

    count = 0
    for cfg in SP_MESH_CONFIGS:
        comm = SimulatedRanks(cfg)
        for rank in range(cfg.ranks):
            got = group_of(rank, cfg)
            try:
                got = [int(r) for r in got]
            except (TypeError, ValueError):
                raise _Wrong(f"your function returned {got!r}; return a list of global "
                             f"ranks.") from None
            want = next(m for m in comm.groups("tp") if rank in m)
            if got == want:
                count += 1
                continue
            where = f"on {_mesh_shape(cfg)}, for rank {rank}"
            if got == next(m for m in comm.groups("dp") if rank in m):
                raise _Wrong(f"{where} you gave its DP group {got}: the same size when DP = "
                             f"TP, so the shapes are right, but the all-gather then mixes "
                             f"other replicas' tokens in (NVIDIA/Megatron-LM issue 7452, "
                             f"CrossAttention's linear_q/linear_kv built without tp_group).")
            if sorted(got) == sorted(want):
                raise _Wrong(f"{where} you gave its TP group in the order {got}; the "
                             f"all-gather concatenates in group order {want}, tp rank 0 "
                             f"first.")
            raise _Wrong(f"{where} you gave {got}; its TP group is the ranks dp * W + t "
                         f"for t = 0 .. W-1 of its own replica dp.")
    return (f"every rank gathers over its own TP group, in order, on {len(SP_MESH_CONFIGS)} "
            f"meshes ({count} ranks): the gathered sequence is its own replica's.")


@_exercise("the sequence all-gather on a mesh", AROUND_CHAPTER)
def check_sp_gather_tokens(gather) -> str:
    """Check ``gather(tokens, cfg) -> list``: given every rank's own ``[S/W, B, hidden]``
    tokens (a list of ``cfg.ranks`` tensors, mesh order), every rank's all-gathered
    ``[S, B, hidden]`` sequence (one tensor per rank), compared bit for bit with the
    simulated ranks' all-gather over each TP group (``SimulatedRanks.group_cat``)."""
    from tpattn.parallel.collectives import SimulatedRanks

    count = 0
    for cfg in SP_MESH_CONFIGS:
        comm = SimulatedRanks(cfg)
        for seed in EXTRA_SEEDS:
            g = torch.Generator().manual_seed(seed)
            tokens = [torch.randn(cfg.local_seq, cfg.batch, cfg.hidden, generator=g)
                      for _ in range(cfg.ranks)]
            got = _tensor_list(gather([t.clone() for t in tokens], cfg), cfg.ranks,
                               [cfg.seq, cfg.batch, cfg.hidden], "a gathered sequence")
            want = comm.group_cat(torch.stack(tokens), 0)
            wrong = comm.group_cat(torch.stack(tokens), 0, "dp") \
                if cfg.data_parallel == cfg.world_size else None
            where = f"on {_mesh_shape(cfg)} (seed {seed})"
            for r in range(cfg.ranks):
                if torch.equal(got[r], want[r]):
                    continue
                if wrong is not None and torch.equal(got[r], wrong[r]):
                    raise _Wrong(f"{where}, rank {r} gathered over its DP group: the right "
                                 f"shape, but chunk by chunk the tokens of every replica "
                                 f"(NVIDIA/Megatron-LM issue 7452).")
                raise _Wrong(f"{where}, rank {r}'s gathered sequence is not its TP group's "
                             f"tokens in TP order.")
            count += 1
    return (f"every rank's gathered sequence is its own TP group's tokens in order on "
            f"{count} cases ({len(EXTRA_SEEDS)} seeds x {len(SP_MESH_CONFIGS)} meshes).")


# --- chapter 17, around the block: loading a checkpoint into ranks -------------------------

__all__ += ["check_load_grouped_qkv", "check_loading_verdict"]

#: Shapes the loading exercises are graded on: two KV groups per rank (W=2), one group per
#: rank (W=4, where reading the rows as plain [Q; K; V] happens to be right), four groups of
#: three query heads per rank, and two groups per rank at W=4.
LOADING_CONFIGS = (
    Config(query_heads=8, kv_heads=4),
    Config(query_heads=8, kv_heads=4, world_size=4),
    Config(seq=3, batch=1, hidden=8, query_heads=24, kv_heads=8, head_dim=2),
    Config(seq=4, query_heads=16, kv_heads=8, world_size=4),
)


@_exercise("load your rank's rows of a grouped QKV checkpoint", AROUND_CHAPTER)
def check_load_grouped_qkv(load) -> str:
    """Check ``load(w, cfg, tp_rank) -> (wq, wk, wv)``: rank ``tp_rank``'s query, key and
    value rows (``[Hq/W*D, hidden]``, ``[Hkv/W*D, hidden]`` x 2) from the full checkpoint
    ``w`` fused per KV group (``tpattn.block.fused_qkv.fuse_qkv_weight(..., "grouped")``:
    for each group its query heads, its key head, its value head), as differentiable slices
    of ``w``. Graded against the rank's heads (``shard_params``) on ``LOADING_CONFIGS``."""
    from tpattn.block.fused_qkv import fuse_qkv_weight, read_rank_qkv, rank_row_block
    for cfg in LOADING_CONFIGS:
        p = init_params(cfg, 7 + PARAM_SEED_OFFSET)
        w = fuse_qkv_weight(p["wq"], p["wk"], p["wv"], cfg, "grouped").requires_grad_(True)
        right = shard_params(p, cfg)
        for rank in range(cfg.world_size):
            got = load(w, cfg, rank)
            if not isinstance(got, (tuple, list)) or len(got) != 3:
                raise _Wrong("your function should return three tensors: (wq, wk, wv).")
            where = f"for rank {rank} of {_shape(cfg)}"
            for name, t in zip(("wq", "wk", "wv"), got):
                _expect_shape(_tensor(t, f"your {name}"), right[rank][name].shape,
                              f"{where} your {name}")
            if all(torch.equal(a.detach(), right[rank][k])
                   for a, k in zip(got, ("wq", "wk", "wv"))):
                if not all(t.requires_grad for t in got):
                    raise _Wrong(f"{where} the rows are right but not slices of w: keep them "
                                 f"differentiable (no detach, no copy through numpy).")
                continue
            if rank > 0 and all(torch.equal(a.detach(), right[0][k])
                                for a, k in zip(got, ("wq", "wk", "wv"))):
                raise _Wrong(f"{where} you loaded rank 0's rows: narrow at this rank's "
                             f"offset, tp_rank * rows_per_rank (the loader of "
                             f"vllm-gguf-plugin issue 103 never got tp_rank).")
            plain = read_rank_qkv(w.detach()[rank_row_block(cfg, rank)], cfg, "plain")
            if all(torch.equal(a.detach(), b) for a, b in zip(got, plain)):
                raise _Wrong(f"{where} you read the rank's rows as [Q; K; V], but they are "
                             f"{cfg.local_kv_heads} groups [q x {cfg.group_size}; k; v]: "
                             f"split them per group (tenstorrent/tt-metal issue 6243).")
            bad = [k for a, k in zip(got, ("wq", "wk", "wv"))
                   if not torch.equal(a.detach(), right[rank][k])]
            raise _Wrong(f"{where} your {', '.join(bad)} rows are not the rank's heads.")
    return (f"every rank of {len(LOADING_CONFIGS)} shapes loads exactly its heads' rows, "
            f"per KV group, as slices of the checkpoint.")


#: The answers of ``check_loading_verdict``: the loading bugs it asks about, or None.
LOADING_VERDICTS = ("qkv_loaded_from_rank0", "grouped_qkv_read_as_plain",
                    "fused_qkv_naive_split", None)


@functools.lru_cache(maxsize=None)
def _loading_observations() -> tuple:
    """``(name, answer, cfg, seed, shard_checksums, shard_scale)`` of observed runs: the
    three loading bugs, correct loads of both checkpoints and a made-up wrong rank order
    (answer None), on two shapes (tier 1: ``observe_injection(..., reference=False)``)."""
    from tpattn.bugs.zoo import get_mode
    from tpattn.diagnosis.observe import observe_injection
    cases = [(m, m, get_mode(m).injection) for m in LOADING_VERDICTS if m is not None]
    cases += [("correct (grouped)", None, Injection(shard="grouped")),
              ("correct (fused)", None, Injection(shard="fused")),
              ("shards in the wrong rank order", None, Injection(shard="fused",
                                                                 shard_offset=1))]
    out = []
    for cfg, seed in ((Config(query_heads=8, kv_heads=4), 5),
                      (Config(seq=4, query_heads=16, kv_heads=8, world_size=4), 11)):
        for name, answer, inj in cases:
            obs = observe_injection(inj, seed, cfg, steps=1, reference=False)
            out.append((name, answer, cfg, seed, obs["shard_checksums"], obs["shard_scale"]))
    return tuple(out)


@_exercise("tell the loading bugs apart from the shard checksums", AROUND_CHAPTER)
def check_loading_verdict(verdict) -> str:
    """Check ``verdict(checksums, scale) -> str | None``: from ``observe``'s
    ``shard_checksums`` (per parameter, every rank's loaded sum minus its checkpoint
    slice's) and ``shard_scale`` (per parameter, the sum of ``|w|``), which loading bug the run
    has (one of ``LOADING_VERDICTS``) or None. Graded on observed runs of the three loading
    bugs, correct loads and a made-up one (every shard from the wrong rank)."""
    import copy
    for name, answer, cfg, seed, sums, scale in _loading_observations():
        got = verdict(copy.deepcopy(sums), dict(scale))
        if got not in LOADING_VERDICTS:
            raise _Wrong(f"you returned {got!r}; return one of "
                         f"{', '.join(map(str, LOADING_VERDICTS))}.")
        if got == answer:
            continue
        where = f"for {name} on {_shape(cfg)} (seed {seed})"
        if answer is None and all(abs(d) > 1e-5 * max(scale["wo"], 1.0) for d in sums["wo"]):
            raise _Wrong(f"{where} you said {got}, but wo is off on every rank too: each rank "
                         f"loaded another rank's whole shard, none of the three bugs.")
        if answer is None:
            raise _Wrong(f"{where} you said {got}, but every rank's checksums match its "
                         f"slice: nothing was loaded wrong.")
        hint = {"qkv_loaded_from_rank0": "rank 0's Q/K/V are right and every other rank's "
                                         "are off",
                "grouped_qkv_read_as_plain": "every rank's Q, K and V are off but their sum "
                                             "is right: its own rows under the wrong names",
                "fused_qkv_naive_split": "rank 0's query rows are right, its key and value "
                                         "rows are not"}[answer]
        raise _Wrong(f"{where} you said {got}: {hint}, which is {answer}.")
    return (f"right on all {len(_loading_observations())} observed runs: which ranks are off, "
            f"and whether a rank's Q, K and V sums add up, tell the loaders apart.")
