"""What the checkers share: ``Result``, the ``exercise`` decorator, the checked shapes and seeds,
and the grading patterns (types and shapes, the sum per rank, a predicted set of names)."""
from __future__ import annotations

import functools
import html
import os
import sysconfig
import textwrap
import traceback
from dataclasses import dataclass, replace

import torch

from tpattn.block.params import PARAM_NAMES, QK_NORM_NAMES, shard_params
from tpattn.bugs.modes import resolve
from tpattn.check.core import (EQUIVALENCE, LR, MEASURES, TOLERANCE, dense_reference,
                               five_measures, make_inputs, make_params, max_abs_diff, tp_step)
from tpattn.config import Config
from tpattn.parallel.injection import Injection
from tpattn.parallel.simulated import simulated_step

#: Seeds of the checkers of chapters 5-11: two of the original fixture's, one never shown.
CHECKED_SEEDS = (11, 17, 5)
#: Seeds of the slower checkers (chapters 12 on): one of the original fixture's, one never shown.
EXTRA_SEEDS = (11, 5)
#: The original fixture's shape; 8 query heads sharing 4 KV heads on 4 ranks; a small odd one.
CHECKED_CONFIGS = (
    Config(),
    Config(query_heads=8, kv_heads=4, world_size=4),
    Config(seq=3, batch=1, hidden=8, query_heads=6, kv_heads=2, head_dim=2),
)
#: The chapters the messages point to.
CHAPTERS = {n: f"chapter {n} ({title})" for n, title in enumerate((
    "the dense block", "head sharding", "the two reductions", "the missing output reduce",
    "the missing input-gradient reduce", "the matrix", "real ranks", "sequence parallelism",
    "fewer KV heads than ranks", "equal at scale", "your model", "the bug zoo",
    "around the block", "debugging without dense", "the whole model",
    "a loss curve you can trust"), start=5)}
#: Width of the text paragraph (the book's code column).
WIDTH = 75


@dataclass(frozen=True)
class Result:
    """A checker's verdict: ``passed`` and ``message``, one paragraph (text or HTML)."""

    exercise: str
    passed: bool
    message: str

    def __repr__(self) -> str:
        mark = "✓ " if self.passed else "✗ "
        return textwrap.fill(f"{mark}{self.exercise}: {self.message}", WIDTH)

    def _repr_html_(self) -> str:
        color = "#1a7f37" if self.passed else "#b35900"
        verdict = "✓ right" if self.passed else "✗ not yet"
        return (f'<p style="border-left: 4px solid {color}; padding-left: 0.6em">'
                f'<strong style="color: {color}">{verdict}</strong> — '
                f'<em>{html.escape(self.exercise)}</em>: {html.escape(self.message)}</p>')


class Wrong(Exception):
    """Raised inside a checker to end it with a failing message."""


_EXERCISES_DIR = os.path.dirname(os.path.abspath(__file__))
_PACKAGE_DIR = os.path.dirname(_EXERCISES_DIR)
_LIBRARY_DIRS = tuple({os.path.abspath(p) for p in (
    os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"],
    sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]) if p})


def _is_reader_file(filename: str) -> bool:
    """True for a frame of the reader's code: not the package, torch, the stdlib or a library."""
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    return not path.startswith(_PACKAGE_DIR) and not path.startswith(_LIBRARY_DIRS)


def _first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, at most 160 characters."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if len(text) <= 160 else text[:157] + "..."


def reader_error(e: BaseException) -> str:
    """One sentence: where in the reader's code the error arose, and what it was."""
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if _is_reader_file(f.filename)]
    what = type(e).__name__ + (f" ({_first_line(e)})" if _first_line(e) else "")
    if mine:
        frame = mine[-1]
        code = f": `{frame.line.strip()}`" if frame.line and frame.line.strip() else ""
        return f"your code raised {what} at line {frame.lineno} of {frame.name}{code}."
    if isinstance(e, TypeError) and frames and \
            os.path.dirname(os.path.abspath(frames[-1].filename)) == _EXERCISES_DIR:
        return (f"calling your code failed with {what}: its parameters and what it returns "
                f"should be as the task says.")
    where = f" in {os.path.basename(frames[-1].filename)}, line {frames[-1].lineno}" \
        if frames else ""
    return (f"running your code through the package raised {what}{where}; check the types "
            f"and shapes your code returns against the task.")


def name_of(answer) -> str:
    """The answer's name in backticks (``A`` or ``B`` for a tuple), else 'your code'."""
    if isinstance(answer, tuple):
        return " or ".join(name_of(a) for a in answer)
    name = getattr(answer, "__name__", None)
    return f"`{name}`" if name else "your code"


def exercise(name: str, chapter: int):
    """A checker returning ``body``'s success message or ``Wrong``'s as a ``Result``."""

    def decorate(body):
        @functools.wraps(body)
        def checker(answer) -> Result:
            try:
                message = body(answer)
            except Wrong as e:
                return Result(name, False, f"{e} See {CHAPTERS[chapter]}.")
            except NotImplementedError:
                stub = f"replace `raise NotImplementedError` in {name_of(answer)} with your code"
                return Result(name, False, f"not written yet: {stub}, then run this cell again.")
            except Exception as e:  # noqa: BLE001 - the reader's code may raise anything
                return Result(name, False, reader_error(e) + f" See {CHAPTERS[chapter]}.")
            return Result(name, True, message)

        checker.chapter = chapter
        return checker

    return decorate


# --- cases and their words ------------------------------------------------------------------

def shape_text(cfg: Config) -> str:
    """A shape in words: heads and ranks, then what differs from the original fixture's."""
    text = f"{cfg.query_heads} query / {cfg.kv_heads} KV heads on {cfg.world_size} ranks"
    if (cfg.seq, cfg.batch, cfg.hidden, cfg.head_dim) != (5, 2, 16, 4):
        text += f" (seq {cfg.seq}, batch {cfg.batch}, hidden {cfg.hidden}, head_dim {cfg.head_dim})"
    if cfg.dtype != "float32":
        text += f" in {cfg.dtype}"
    return text


def mesh_text(cfg: Config) -> str:
    """A TP x DP mesh in words."""
    return (f"TP {cfg.world_size} x DP {cfg.data_parallel}"
            + (" with sequence parallelism" if cfg.sequence_parallel else ""))


def coverage() -> str:
    """The checked seeds and shapes in words."""
    return (f"{len(CHECKED_SEEDS)} seeds × {len(CHECKED_CONFIGS)} shapes, among them "
            f"{shape_text(CHECKED_CONFIGS[1])} and {shape_text(CHECKED_CONFIGS[2])}")


def counted(configs, seeds, more: str = "", unit: str = "shapes", times: str = "×") -> str:
    """'N cases (S seeds × C shapes<more>)': every shape × seed of ``cases(configs, seeds)``."""
    return (f"{len(configs) * len(seeds)} cases ({len(seeds)} seeds {times} {len(configs)} "
            f"{unit}{more})")


def cases(configs=CHECKED_CONFIGS, seeds=CHECKED_SEEDS, inj: Injection = Injection()):
    """``(cfg, seed, x0, target, base)`` per shape × seed, as ``tpattn.run`` draws ``inj``'s."""
    for cfg in configs:
        for seed in seeds:
            x0, target = make_inputs(cfg, seed)
            yield cfg, seed, x0, target, make_params(cfg, seed, inj)


def failing(metrics: dict) -> list[str]:
    """The measures of a ``five_measures`` dict at or above ``TOLERANCE``, in order."""
    return [m for m in MEASURES if metrics[m] >= TOLERANCE]


def must_pass(seed: int, dense: dict, tp: dict, where: str) -> None:
    """``Wrong(where + the measures)`` if ``tp`` fails against ``dense`` (``one_step`` dicts)."""
    fails = failing(five_measures(seed, EQUIVALENCE, dense, tp))
    if fails:
        raise Wrong(f"{where} {', '.join(fails)}.")


# --- types and shapes -----------------------------------------------------------------------

def tensor(value, what: str) -> torch.Tensor:
    """``value`` if it is a tensor, else ``Wrong`` naming ``what``."""
    if not isinstance(value, torch.Tensor):
        raise Wrong(f"{what} should be a torch.Tensor, but your code gave {type(value).__name__}.")
    return value


def expect_shape(t: torch.Tensor, shape, what: str) -> None:
    """``Wrong`` unless ``t`` has ``shape``."""
    if list(t.shape) != list(shape):
        raise Wrong(f"{what} has shape {list(t.shape)}; it should be {list(shape)}.")


def tensor_list(value, count: int, shape, what: str) -> list[torch.Tensor]:
    """``value`` as a list of ``count`` tensors of ``shape``, one per rank, else ``Wrong``."""
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise Wrong(f"your function should return a list of {count} tensors, one per rank "
                    f"({what}).")
    for r, t in enumerate(value):
        expect_shape(tensor(t, f"rank {r}'s {what}"), shape, f"rank {r}'s {what}")
    return list(value)


def rank_dicts(value, cfg: Config) -> list:
    """``value`` if it is a list of one dict per rank (the dicts unchecked), else ``Wrong``."""
    if not isinstance(value, (list, tuple)) or len(value) != cfg.world_size:
        raise Wrong(f"for {shape_text(cfg)} your function should return a list of "
                    f"{cfg.world_size} dicts, one per rank.")
    return value


def number(value, types, wrong: str):
    """``value`` (a one-element tensor's item) if of ``types``, not bool, else ``Wrong(wrong)``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, types):
        raise Wrong(wrong.format(type(value).__name__))
    return value


def keyed(value, keys: tuple[str, str]) -> dict:
    """``value`` if it is a dict with exactly the two ``keys``, else ``Wrong``."""
    if not isinstance(value, dict) or set(value) != set(keys):
        raise Wrong(f"your function should return a dict with the keys {keys[0]!r} and "
                    f"{keys[1]!r}.")
    return value


def head_of(block: torch.Tensor, dense: torch.Tensor, rows_per_head: int) -> int | None:
    """Which head of ``dense`` (blocks of ``rows_per_head`` rows) ``block`` is, or None."""
    for h in range(dense.shape[0] // rows_per_head):
        if torch.equal(block, dense[h * rows_per_head:(h + 1) * rows_per_head]):
            return h
    return None


# --- the sum, not the mean or the own share ---------------------------------------------------

def near(a: torch.Tensor, b: torch.Tensor, terms: int) -> bool:
    """Equal up to the rounding of a sum of ``terms`` terms of size ~ max |b| (or |a|)."""
    scale = max(a.detach().abs().max().item(), b.detach().abs().max().item(), 1e-30)
    bound = 4 * terms * torch.finfo(b.dtype).eps * scale
    return bool((a.detach() - b.detach()).abs().max() <= bound)


def first_near(got: torch.Tensor, options, otherwise: str) -> None:
    """``Wrong(message)`` of the first ``(tensor, terms, message)`` ``got`` is ``near``."""
    for value, terms, message in options:
        if near(got, value, terms):
            if message is None:
                return
            raise Wrong(message)
    raise Wrong(otherwise)


def grade_sum(got: list, own: list, mean, mine, other) -> None:
    """``Wrong`` unless each ``got[r]`` is the sum of ``own``: ``mean(r)`` for the mean,
    ``mine(r)`` for its own share, else ``other(r)``."""
    n = len(own)
    total = sum(own[1:], own[0])
    for r in range(n):
        first_near(got[r], [(total, n, None), (total / n, n, mean(r)), (own[r], 1, mine(r))],
                   other(r))


def reader_list(reduce, own: list, what: str, *args) -> list[torch.Tensor]:
    """``reduce`` of copies of ``own`` (then ``args``): a tensor per rank like ``own``'s."""
    return tensor_list(reduce([t.clone() for t in own], *args), len(own), list(own[0].shape), what)


def summed(reduce, own: list, what: str, mean, mine, other) -> list[torch.Tensor]:
    """The reader's ``reduce`` of ``own`` (per rank), detached, graded by ``grade_sum``."""
    got = reader_list(reduce, own, what)
    grade_sum(got, own, mean, mine, other)
    return [t.detach() for t in got]


def correct_with(**stages):
    """The correct ``Program`` with ``stages`` (the reader's code, graded) in place of its own."""
    return replace(Injection().program(), **stages)


def same_batch_step(base: dict, x0, target, cfg: Config, program, **kwargs) -> dict:
    """A ``simulated_step`` of ``program`` from ``base``'s shards, each rank on ``(x0, target)``."""
    return simulated_step(shard_params(base, cfg), [(x0, target)] * cfg.world_size, cfg,
                          program, LR, **kwargs)


# --- a predicted set of names against the runs of a mode -------------------------------------

def as_names(prediction, allowed, what: str) -> set[str]:
    """The reader's prediction as a set of ``allowed`` names, else ``Wrong``."""
    if isinstance(prediction, str) or not isinstance(prediction, (set, frozenset, list, tuple)):
        raise Wrong(f"your prediction should be a set of {what} names (e.g. {{'{allowed[0]}'}}), "
                    f"but it is {type(prediction).__name__}.")
    unknown = [p for p in prediction if p not in allowed]
    if unknown:
        raise Wrong(f"{', '.join(map(repr, unknown))} is not one of the {what} names: "
                    f"{', '.join(allowed)}.")
    return set(prediction)


@functools.lru_cache(maxsize=None)
def mode_runs(mode: str, configs=CHECKED_CONFIGS, seeds=CHECKED_SEEDS) -> tuple:
    """Per shape × seed, ``mode`` on simulated ranks: its failing measures, wrong gradients."""
    found = []
    for cfg, seed, x0, target, base in cases(configs, seeds):
        dense = dense_reference(x0, target, base, cfg)
        names = PARAM_NAMES + (QK_NORM_NAMES if cfg.qk_norm else ())
        tp = tp_step(x0, target, base, cfg, resolve(mode, cfg).injection, "ranks",
                     rng_seed=seed if cfg.qk_norm else None)
        hit = frozenset(k for k in names
                        if max_abs_diff(dense["grads"][k], tp["grads"][k]) >= TOLERANCE)
        found.append((frozenset(failing(five_measures(seed, mode, dense, tp))), hit))
    return tuple(found)


def grade_prediction(predict, mode: str, hits: bool = False, configs=CHECKED_CONFIGS,
                     seeds=CHECKED_SEEDS) -> str:
    """Grade ``predict() -> set``: the measures that fail on every run of ``mode`` or, with
    ``hits``, the parameters whose gradients it makes wrong (all runs agree: a test asserts it)."""
    noun, what = ("parameter", "parameter gradients") if hits else ("measure", "measures")
    order = PARAM_NAMES + (QK_NORM_NAMES if configs[0].qk_norm else ()) if hits else MEASURES
    predicted = as_names(predict(), order, noun)
    found = [set(run[hits]) for run in mode_runs(mode, configs, seeds)]
    always = found[0]
    missed = [n for n in order if n in always - predicted]
    extra = [n for n in order if n in predicted - always]
    wrong = (("left out", missed, "fail", "s"), ("named", extra, "pass", "es"))
    parts = [f"you {said} {', '.join(names)}, which {verb}{end if len(names) == 1 else ''} on "
             f"every run" for said, names, verb, end in wrong if names]
    if parts:
        raise Wrong(f"not quite: {' and '.join(parts)} of {mode} ({len(found)} runs: "
                    f"{len(seeds)} seeds × {len(configs)} shapes).")
    return (f"right: on all {len(found)} runs of {mode} ({len(seeds)} seeds × {len(configs)} "
            f"shapes, each rank training its own shard), exactly the {what} you named fail.")


def function_class(obj, default: str) -> str:
    """The name of ``obj`` if it is a ``torch.autograd.Function`` subclass, else ``Wrong``."""
    if not (isinstance(obj, type) and issubclass(obj, torch.autograd.Function)):
        raise Wrong(f"{default} should be a subclass of torch.autograd.Function (a class with "
                    f"static forward and backward), but it is {type(obj).__name__}.")
    return obj.__name__
