"""tpattn.exercises: every checker accepts the book's reference solution and rejects known-wrong
answers with the right message; a reader's exception becomes one sentence, a stub 'not written
yet'.

The reference solutions are read from the chapter notebooks (cells tagged
``exercise-solution``), so no second copy exists; the wrong answers live here only.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tpattn
from tpattn import exercises as ex
from tpattn.check.core import LR, MEASURES, MISSING_KV_GRAD_REDUCE
from tpattn.exercises import in_the_wild, real_ranks
from tpattn.exercises.graders import EXTRA_SEEDS, mode_runs
from tpattn.block.dense import attend_and_project

from tests.exercises.test_loss_curve import WRONG_LOSS_CURVE
from tests.wrong_answers_later import WRONG_LATER
from tests.wrong_answers_whole_model import WRONG_WHOLE_MODEL

BOOK = Path(__file__).resolve().parents[2] / "book"
CHECK_CALL = re.compile(r"^exercises\.(check_\w+)\((.+)\)$")


def exercise_cells():
    """(notebook, checker name, answer name, stub code, solution code) per exercise."""
    found = []
    for path in sorted(BOOK.glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for i, cell in enumerate(cells):
            if "exercise-solution" in cell["metadata"].get("tags", []):
                match = CHECK_CALL.match("".join(cells[i + 1]["source"]).strip())
                assert match, f"{path.name}: the cell after a solution must call its checker"
                stub_check = CHECK_CALL.match("".join(cells[i - 2]["source"]).strip())
                assert stub_check and stub_check.groups() == match.groups(), path.name
                assert "hide-input" in cell["metadata"]["tags"]
                found.append((path.name, *match.groups(), "".join(cells[i - 3]["source"]),
                              "".join(cell["source"])))
    return found


EXERCISES = exercise_cells()



def load(code: str, answer: str, where: str):
    """Run a notebook cell's code; return the value of ``answer`` (the checker's argument)."""
    namespace = {"__name__": "reader"}
    exec(compile(code, where, "exec"), namespace)
    return eval(answer, namespace)


def solution(checker: str):
    for nb, check, name, _, code in EXERCISES:
        if check == checker:
            return load(code, name, f"<{nb}>")
    raise LookupError(checker)


def test_every_chapter_from_5_on_has_two_exercises_and_every_checker_is_used():
    per_chapter = {}
    for nb, check, *_ in EXERCISES:
        per_chapter.setdefault(nb[:2], []).append(check)
    assert sorted(k for k in per_chapter if k.isdigit()) == [f"{n:02d}" for n in range(5, 21)]
    assert all(len(checks) >= 2 for checks in per_chapter.values())
    assert len(per_chapter["17"]) == 10  # two per section of "Around the block"
    used = [check for _, check, *_ in EXERCISES]
    assert sorted(used) == sorted(n for n in ex.__all__ if n.startswith("check_"))


@pytest.mark.parametrize("nb, checker, name, stub, code", EXERCISES,
                         ids=[f"{e[0][:2]}-{e[1]}" for e in EXERCISES])
def test_checker_accepts_the_reference_solution_and_reports_the_stub(nb, checker, name, stub, code):
    result = getattr(ex, checker)(load(code, name, f"<{nb}>"))
    assert result.passed, result.message
    assert "\n" not in result.message
    stubbed = getattr(ex, checker)(load(stub, name, f"<{nb} stub>"))
    assert not stubbed.passed
    assert stubbed.message.startswith("not written yet: replace `raise NotImplementedError`")


def test_import_tpattn_does_not_import_exercises():
    code = "import sys, tpattn; assert 'tpattn.exercises' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_solution_lives_in_the_package():
    source = "".join(path.read_text() for path in Path(ex.__file__).parent.glob("*.py"))
    assert "def train_step" not in source and "def keeps_groups" not in source
    assert "class G(" not in source and "def check_hunts(" in source
    assert "def reduce_kv_grads" not in source and "def shard_interleaved" not in source
    assert "def forward_with_bias" not in source and "def guess" not in source


# --- known-wrong answers, each with the message that must name its mistake -------------------

def step_with(loss_fn=F.mse_loss, lr=LR, in_place=False):
    def train_step(x0, target, params, cfg):
        p = params if in_place else tpattn.clone_trainable(params)
        if in_place:
            for t in p.values():
                t.requires_grad_(True)
        x = x0.clone().requires_grad_(True)
        y = tpattn.dense_forward(x, p, cfg)
        loss = loss_fn(y, target)
        loss.backward()
        with torch.no_grad():
            if in_place:
                for t in p.values():
                    t -= lr * t.grad
                weights = {k: t.clone() for k, t in p.items()}
            else:
                weights = {k: p[k] - lr * p[k].grad for k in p}
        return {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad,
                "grads": {k: p[k].grad for k in p}, "weights": weights}
    return train_step


def measures_with(reduce_forward=torch.max, params=None, signed=False):
    def measures(dense, tp):
        def diff(a, b, reduce=torch.max):
            d = a - b if signed else (a - b).abs()
            return reduce(d).item()
        keys = params or list(dense["grads"])
        return {"forward_max_abs_diff": diff(dense["output"], tp["output"], reduce_forward),
                "loss_abs_diff": diff(dense["loss"], tp["loss"]),
                "input_grad_max_abs_diff": diff(dense["input_grad"], tp["input_grad"]),
                "parameter_grad_max_abs_diff": max(diff(dense["grads"][k], tp["grads"][k])
                                                   for k in keys),
                "post_step_weight_max_abs_diff": max(diff(dense["weights"][k], tp["weights"][k])
                                                     for k in keys)}
    return measures


def shard_with(kv_rank=lambda r, w: r, wo_rows=False, detach=False):
    def shard(params, cfg):
        d = cfg.head_dim
        q, kv = cfg.local_query_heads * d, cfg.local_kv_heads * d
        out = []
        for r in range(cfg.world_size):
            k = kv_rank(r, cfg.world_size)
            mine = {"norm": params["norm"], "wq": params["wq"][r * q:(r + 1) * q],
                    "wk": params["wk"][k * kv:(k + 1) * kv], "wv": params["wv"][k * kv:(k + 1) * kv],
                    "wo": params["wo"][r * q:(r + 1) * q] if wo_rows else params["wo"][:, r * q:(r + 1) * q]}
            out.append({n: t.detach() for n, t in mine.items()} if detach else mine)
        return out
    return shard


def mlp_with(detach_n=False, gelu_after_g=False, dense_parts=False, call_g=True):
    """A tp_mlp with one mistake: n detached per rank (no f), GELU after the sum, the dense
    MLP split W ways, or g not called."""
    def tp_mlp(n, fc1, fc2, w, g):
        if dense_parts:
            return g([F.linear(F.gelu(F.linear(n, fc1)), fc2) / w] * w)
        block, parts = fc1.shape[0] // w, []
        for r in range(w):
            rows = slice(r * block, (r + 1) * block)
            h = F.linear(n.detach() if detach_n else n, fc1[rows])
            parts.append(F.linear(h if gelu_after_g else F.gelu(h), fc2[:, rows]))
        out = g(parts) if call_g else sum(parts)
        return F.gelu(out) if gelu_after_g else out
    return tp_mlp


def gate_up_detached(gate_up, w):
    gates, ups = (half.chunk(w) for half in gate_up.chunk(2))
    return [torch.cat([a, b]).detach() for a, b in zip(gates, ups)]


def fingerprint_with(which):
    def fingerprint(x, params, cfg):
        n = tpattn.rms_norm(x, params["norm"], cfg.eps)
        partials = [attend_and_project(n, s, cfg) for s in tpattn.shard_params(params, cfg)]
        return which(partials)
    return fingerprint


def forward_first_diagnose(result):
    if result["forward_max_abs_diff"] >= tpattn.TOLERANCE:
        return tpattn.MISSING_OUTPUT_REDUCE
    if result["input_grad_max_abs_diff"] >= tpattn.TOLERANCE:
        return tpattn.MISSING_INPUT_GRAD_REDUCE
    return tpattn.EQUIVALENCE


def swapped_diagnose(result):
    mode = solution("check_diagnose")(result)
    swap = {tpattn.MISSING_OUTPUT_REDUCE: tpattn.MISSING_INPUT_GRAD_REDUCE,
            tpattn.MISSING_INPUT_GRAD_REDUCE: tpattn.MISSING_OUTPUT_REDUCE}
    return swap.get(mode, mode)


def real_f(reduce: bool):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, n):
            return n.view_as(n)

        @staticmethod
        def backward(ctx, grad):
            total = grad.contiguous().clone()
            if reduce:
                torch.distributed.all_reduce(total)
            return total
    return F


def real_g(reduce: bool, fail: bool = False):
    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            total = partial.contiguous().clone()
            if fail:
                1 / 0
            if reduce:
                torch.distributed.all_reduce(total)
            return total

        @staticmethod
        def backward(ctx, grad):
            return grad
    return G


def nbytes(cfg):
    return cfg.seq * cfg.batch * cfg.hidden * cfg.torch_dtype.itemsize


WRONG = [
    ("check_train_step", step_with(loss_fn=lambda y, t: F.mse_loss(y, t, reduction="sum")),
     "the loss is not the fixture's"),
    ("check_train_step", step_with(lr=-LR), "the weights after the step are wrong"),
    ("check_train_step", step_with(in_place=True), "changed the starting parameters"),
    ("check_five_measures", measures_with(reduce_forward=torch.mean),
     "forward_max_abs_diff is not the largest absolute difference of the outputs"),
    ("check_five_measures", measures_with(params=["wq"]),
     "parameter_grad_max_abs_diff is not the largest absolute difference over the gradients"),
    ("check_five_measures", measures_with(signed=True), "is not the largest absolute"),
    ("check_shard_params", shard_with(kv_rank=lambda r, w: w - 1 - r), "a split group"),
    ("check_shard_params", shard_with(wo_rows=True), "rank 0's wo has shape"),
    ("check_shard_params", shard_with(detach=True), "the gradients do not reach the dense"),
    ("check_keeps_groups", lambda layout, cfg: True,
     "you said it keeps groups complete, but the sharded block with this layout differs"),
    ("check_keeps_groups",
     lambda layout, cfg: all({h % cfg.kv_heads for h in r["query"]} == set(r["kv"]) for r in layout),
     "you said it"),
    ("check_keeps_groups",  # contiguous heads only: rejects groups moved between ranks
     lambda layout, cfg: all(r["kv"] == list(range(i * cfg.local_kv_heads, (i + 1) * cfg.local_kv_heads))
                             and {h // cfg.group_size for h in r["query"]} == set(r["kv"])
                             for i, r in enumerate(layout)),
     "you said it splits a group, but the sharded block with this layout matches dense"),
    ("check_tp_mlp", mlp_with(detach_n=True), "the gradient of n differs"),
    ("check_tp_mlp", mlp_with(gelu_after_g=True), "rank 0's partial is not fc2's columns 0.."),
    ("check_tp_mlp", mlp_with(dense_parts=True), "rank 0's partial is not"),
    ("check_tp_mlp", mlp_with(call_g=False), "your code called g 0 times"),
    ("check_gate_up_shards", lambda gate_up, w: list(gate_up.chunk(w)),
     "which are not the gate and up rows of the same features"),
    ("check_gate_up_shards", gate_up_detached, "the gradient of gate_up differs"),
    ("check_gate_up_shards", lambda gate_up, w: [gate_up] * w, "rank 0's shard has shape [64, 16]"),
    ("check_gate_up_shards", lambda gate_up, w: gate_up, "should return a list of 2 tensors"),
    ("check_missing_g_signature", lambda: {"forward_max_abs_diff"}, "you left out loss_abs_diff"),
    ("check_missing_g_signature", lambda: "forward_max_abs_diff", "should be a set of measure"),
    ("check_missing_g_signature", lambda: {"forward"}, "'forward' is not one of the measure names"),
    ("check_fingerprint", fingerprint_with(lambda p: p[0]), "rank 0's own partial"),
    ("check_fingerprint", fingerprint_with(sum), "the whole branch"),
    ("check_fingerprint", fingerprint_with(lambda p: -sum(p[1:])), "the sign is flipped"),
    ("check_missing_f_signature", lambda: set(MEASURES), "you named forward_max_abs_diff, loss_abs_diff"),
    ("check_missing_f_signature", lambda: {"input_grad_max_abs_diff"},
     "you left out parameter_grad_max_abs_diff, post_step_weight_max_abs_diff"),
    ("check_missing_f_parameters", lambda: set(tpattn.block.params.PARAM_NAMES), "you named wq, wk, wv, wo"),
    ("check_missing_f_parameters", lambda: set(), "you left out norm"),
    ("check_separating_measures", lambda: {"forward_max_abs_diff"}, "can pass or fail in at most 2"),
    ("check_separating_measures", lambda: {"forward_max_abs_diff", "loss_abs_diff"},
     "equivalence and missing_input_grad_reduce pass and fail alike"),
    ("check_separating_measures", lambda: {"input_grad_max_abs_diff", "parameter_grad_max_abs_diff"},
     "missing_output_reduce and missing_input_grad_reduce pass and fail alike"),
    ("check_separating_measures", lambda: {"forward_max_abs_diff", "input_grad_max_abs_diff",
                                           "loss_abs_diff"}, "but two suffice"),
    ("check_diagnose", forward_first_diagnose, "no mode leaves that signature, so the answer is None"),
    ("check_diagnose", swapped_diagnose, "the run came from missing_"),
    ("check_bytes_per_step", lambda cfg: {"f": nbytes(cfg) // cfg.world_size, "g": nbytes(cfg)},
     "divided by the ranks"),
    ("check_bytes_per_step",
     lambda cfg: {"f": cfg.seq * cfg.batch * cfg.hidden * 4, "g": cfg.seq * cfg.batch * cfg.hidden * 4},
     "an element's size depends on cfg.dtype"),
    ("check_real_f_and_g", (real_f(reduce=False), real_g(reduce=True)),
     "on real ranks the forward is right but input_grad_max_abs_diff"),
    ("check_real_f_and_g", (real_f(reduce=True), real_g(reduce=False)),
     "on real ranks the output is not dense's"),
    ("check_real_f_and_g", (real_f(reduce=True), real_g(reduce=True, fail=True)),
     "on real ranks, rank 0 raised ZeroDivisionError"),
    ("check_ledger_counts", lambda mode: {"forward": 1, "backward": 1},
     "for missing_output_reduce, one rank's step issues 0 all-reduces in the forward pass; you said 1"),
    ("check_ledger_counts", lambda mode: {"forward": 1, "backward": 2},
     "for equivalence, one rank's step issues 1 all-reduce in the backward pass; you said 2"),
]


def streams_with(residual=lambda seed, r: seed, attention=lambda seed, r: seed + 2718 + r):
    def seeds(seed, tp_rank):
        return {"residual": residual(seed, tp_rank), "attention": attention(seed, tp_rank)}
    return seeds


def qk_sum_on_rank0(grads):  # the sum, but only rank 0 steps with it
    return [sum(grads)] + [g.clone() for g in grads[1:]]


#: Known-wrong answers to the exercises of chapter "Around the block" (dropout, qk-norm).
WRONG_AROUND_MODEL = [
    ("check_dropout_streams", streams_with(residual=lambda seed, r: seed + r),
     "the ranks draw their residual masks from different seeds"),
    ("check_dropout_streams", streams_with(attention=lambda seed, r: seed + 2718),
     "two ranks draw their attention masks from the same seed"),
    ("check_dropout_streams", streams_with(attention=lambda seed, r: seed - r),
     "an attention stream has the residual stream's seed"),
    ("check_rng_resync", lambda states: states, "the states are the drifted ones, unchanged"),
    ("check_rng_resync", lambda states: states[::-1],
     "the ranks continue from different states"),
    ("check_rng_resync", lambda states: [torch.Generator().get_state() for _ in states],
     "rank 0's state is none the ranks had"),
    ("check_qk_norm_grad_reduce", lambda grads: [sum(grads) / len(grads)] * len(grads),
     "gradient is the ranks' average"),
    ("check_qk_norm_grad_reduce", lambda grads: [g.clone() for g in grads],
     "keeps only its own heads' part"),
    ("check_qk_norm_grad_reduce", qk_sum_on_rank0, "rank 1 keeps only its own heads' part"),
    ("check_qk_norm_hits", lambda: {"q_norm"}, "you left out k_norm"),
    ("check_qk_norm_hits", lambda: {"q_norm", "k_norm", "norm"}, "you named norm"),
]


#: A wrong answer for each shared grading pattern the lists above do not reach.
WRONG_GRADERS = [
    ("check_real_f_and_g", (lambda *ts: ts, None), "F should be a subclass of torch.autograd"),
    ("check_ledger_counts", lambda mode: {"forward": 1},
     "should return a dict with the keys 'forward' and 'backward'"),
    ("check_norm_grad_reduce", lambda grads: grads[:1], "should return a list of 2 tensors"),
    ("check_norm_grad_reduce", lambda grads: [3 * g for g in grads],
     "rank 0's norm gradient is neither the sum of the ranks' shares nor any one of them"),
    ("check_relative_bound", lambda cfg: True, "your bound should be a float, but it is bool"),
    ("check_missing_f_parameters", lambda: ["norm", "norm", "w_q"], "'w_q' is not one of"),
]
ALL_WRONG = (WRONG + WRONG_LATER + WRONG_AROUND_MODEL + WRONG_GRADERS + WRONG_WHOLE_MODEL
             + WRONG_LOSS_CURVE)


@pytest.mark.parametrize("checker, answer, expected", ALL_WRONG,
                         ids=[f"{w[0]}-{i}" for i, w in enumerate(ALL_WRONG)])
def test_checker_rejects_a_known_wrong_answer_with_its_message(checker, answer, expected):
    result = getattr(ex, checker)(answer)
    assert not result.passed
    assert expected in result.message, result.message
    assert "Traceback" not in result.message and "\n" not in result.message


def test_every_checker_has_at_least_two_known_wrong_answers():
    counts = {}
    for checker, *_ in ALL_WRONG:
        counts[checker] = counts.get(checker, 0) + 1
    checkers = [n for n in ex.__all__ if n.startswith("check_")]
    chapters = [getattr(ex, n).chapter for n in checkers]
    assert sum(12 <= c <= 18 and c != 17 for c in chapters) == 12  # 12-16, 18: 2 each
    assert chapters.count(17) == 10  # "Around the block": 2 per section
    assert all(counts.get(n, 0) >= 2 for n in checkers), counts


def test_an_exception_in_the_readers_code_is_one_sentence_naming_the_line():
    def train_step(x0, target, params, cfg):
        p = dict(params)
        return p["w_q"]  # a typo: the key is wq

    result = ex.check_train_step(train_step)
    assert not result.passed
    line = train_step.__code__.co_firstlineno + 2
    assert result.message.startswith(
        f"your code raised KeyError ('w_q') at line {line} of train_step: `return p[\"w_q\"]"), \
        result.message
    assert "Traceback" not in result.message and "\n" not in result.message
    assert result.message.endswith("See chapter 5 (the dense block).")


def test_an_exception_in_the_readers_backward_names_the_backward():
    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, n):
            return n.view_as(n)

        @staticmethod
        def backward(ctx, *grads):
            return grads[0] @ grads[0]  # shapes do not fit

    def tp_mlp(n, fc1, fc2, w, g):
        return mlp_with()(Copy.apply(n), fc1, fc2, w, g)

    result = ex.check_tp_mlp(tp_mlp)
    assert not result.passed
    assert re.match(r"your code raised RuntimeError \(.*\) at line \d+ of backward: "
                    r"`return grads\[0\] @ grads\[0\]", result.message), result.message


def test_a_wrong_call_signature_is_one_sentence():
    result = ex.check_fingerprint(lambda x: x)
    assert not result.passed
    assert result.message.startswith("calling your code failed with TypeError")


def test_result_text_fits_the_column_and_html_is_escaped():
    result = ex.Result("demo", False, "a <b> & " + "word " * 40)
    assert all(len(line) <= ex.WIDTH for line in repr(result).splitlines())
    assert "&lt;b&gt; &amp;" in result._repr_html_()
    assert result._repr_html_().startswith("<p") and "✗ not yet" in result._repr_html_()


@pytest.mark.built_book
@pytest.mark.parametrize("nb", sorted({e[0] for e in EXERCISES}))
def test_the_html_book_shows_the_stubs_message_and_hides_the_solution(nb):
    page = BOOK.parent / "_build" / "html" / "book" / nb.replace(".ipynb", ".html")
    if not page.is_file():
        pytest.skip("the HTML book is not built (make book)")
    html = page.read_text()
    solutions = re.findall(r'<div class="cell tag_hide-input tag_exercise-solution[^"]*"', html)
    assert len(solutions) == sum(1 for e in EXERCISES if e[0] == nb)
    assert html.count("not written yet") == len(solutions)
    assert "Traceback" not in html.split('id="exercises"')[-1]


def test_grade_sum_passes_the_sum_and_names_the_mean_the_own_share_or_neither():
    from tpattn.exercises.graders import Wrong, grade_sum
    own = [torch.tensor([1.0, -2.0]), torch.tensor([3.0, 5.0]), torch.tensor([0.5, 0.25])]
    total = own[0] + own[1] + own[2]
    texts = (lambda r: f"mean on {r}", lambda r: f"own on {r}", lambda r: f"neither on {r}")
    grade_sum([total.clone() for _ in own], own, *texts)
    for got, message in (([total / 3] * 3, "mean on 0"), ([total, own[1], total], "own on 1"),
                         ([total, total, 2 * total], "neither on 2")):
        with pytest.raises(Wrong, match=message):
            grade_sum(got, own, *texts)


def test_each_mode_leaves_one_signature_of_its_own_on_the_checked_runs():
    """Chapter 10's checkers read each mode's failing measures off any one of its runs."""
    signatures = {}
    for cfg in ex.CHECKED_CONFIGS:
        for seed in ex.CHECKED_SEEDS:
            for mode in tpattn.MODES:
                result = tpattn.run(seed, mode, cfg, "ranks")
                signatures.setdefault(mode, set()).add(
                    tuple(m for m in MEASURES if result[m] >= tpattn.TOLERANCE))
    assert all(len(found) == 1 for found in signatures.values()), signatures
    assert len({found.pop() for found in signatures.values()}) == len(tpattn.MODES)


@pytest.mark.parametrize("mode, hits, configs, seeds", [
    (tpattn.MISSING_OUTPUT_REDUCE, False, ex.CHECKED_CONFIGS, ex.CHECKED_SEEDS),
    (tpattn.MISSING_INPUT_GRAD_REDUCE, False, ex.CHECKED_CONFIGS, ex.CHECKED_SEEDS),
    (tpattn.MISSING_INPUT_GRAD_REDUCE, True, ex.CHECKED_CONFIGS, ex.CHECKED_SEEDS),
    ("qk_norm_grad_not_reduced", True, in_the_wild.QK_NORM_CONFIGS[:2], EXTRA_SEEDS),
    (MISSING_KV_GRAD_REDUCE, True, real_ranks.KV_CONFIGS[:2], EXTRA_SEEDS)])
def test_every_run_of_a_predicted_mode_fails_the_same_things(mode, hits, configs, seeds):
    """``grade_prediction`` takes any one run of the mode as the answer."""
    assert len({run[hits] for run in mode_runs(mode, configs, seeds)}) == 1


def test_each_zoo_bug_shows_in_the_forward_on_both_hunt_shapes_or_on_neither():
    """``check_forward_visible`` says 'on both shapes' of every bug it grades."""
    from tpattn.exercises.in_the_wild import _zoo_forward_hits
    assert all(len(hits) == 1 for hits in _zoo_forward_hits().values()), _zoo_forward_hits()
