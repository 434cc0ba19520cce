"""No notebook pays for an import it does not use; ``assert_close_within`` is the light check.

``torch.testing.assert_close`` imports ``torch.distributed.tensor`` (and sympy) on its first
call, about a second per kernel: the notebooks compare with ``tpattn.assert_close_within``
instead, which must be the same check.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpattn
from tpattn.check.core import assert_close_within

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p for p in (ROOT / "book").rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts)
#: A notebook that mentions one of these uses DTensor itself (then torch.testing costs nothing).
USES_DTENSOR = re.compile(r"torch\.distributed\.tensor|DTensor|dtensor_check|dtensor_sp|"
                          r"module_check|check_module|interop")


def code_of(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def loaded_after(code: str, modules: tuple[str, ...]) -> list[str]:
    """Which of ``modules`` are in ``sys.modules`` after running ``code`` in a fresh process."""
    probe = f"{code}\nimport sys; print([m for m in {modules!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return eval(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_notebook_imports_dtensor_through_torch_testing(path):
    code = code_of(path)
    if "torch.testing" in code:
        assert USES_DTENSOR.search(code), (
            f"{path.name} calls torch.testing (which imports torch.distributed.tensor) but uses "
            f"no DTensor: compare with tpattn.assert_close_within")


def test_assert_close_within_does_not_import_dtensor():
    code = ("import torch, tpattn\n"
            "tpattn.assert_close_within(torch.ones(3), torch.ones(3), rtol=0, atol=1e-6)\n"
            "try:\n"
            "    tpattn.assert_close_within(torch.zeros(3), torch.ones(3), rtol=0, atol=1e-6)\n"
            "except AssertionError:\n"
            "    pass\n"
            "else:\n"
            "    raise SystemExit('no AssertionError')")
    heavy = ("torch.distributed.tensor", "sympy")
    assert loaded_after(code, heavy) == []
    # the probe can see the import it guards against
    assert "torch.distributed.tensor" in loaded_after(
        "import torch; torch.testing.assert_close(torch.ones(1), torch.ones(1))", heavy)


def test_the_modules_the_early_chapters_import_stay_light():
    # chapters 1-10 import these (their first cells); none needs DTensor, widgets or HF
    code = ("import tpattn, tpattn.check.core, tpattn.block.dense, tpattn.block.params, tpattn.block.layers, "
            "tpattn.parallel.tp, tpattn.check.stack, tpattn.source, tpattn.exercises")
    heavy = ("torch.distributed.tensor", "transformers", "ipywidgets", "matplotlib",
             "hypothesis", "tpattn.viz", "tpattn.widgets")
    assert loaded_after(code, heavy) == []


def test_printing_measures_and_the_html_bug_hunt_do_not_load_matplotlib():
    # chapter 15 prints viz.format_measure; chapter 18's bug hunt explorer shows only HTML
    code = ("from tpattn import viz\n"
            "from tpattn.viz import format_measure, measures_table\n"
            "assert format_measure(1e-9) == '1.00e-09'\n"
            "from tpattn.widgets.bug_hunt import bug_hunt_explorer\n"
            "explorer = bug_hunt_explorer(hunt=2)\n"
            "explorer._repr_mimebundle_()\n"
            "explorer.controls['hunt'].value = 3\n"
            "assert explorer.redraws == 2 and explorer.output.outputs")
    assert loaded_after(code, ("matplotlib",)) == []
    # the probe sees matplotlib as soon as a figure's name is used
    assert loaded_after("from tpattn import viz; viz.heads_layout", ("matplotlib",)) == ["matplotlib"]


def test_the_lazy_packages_give_the_modules_own_objects():
    from tpattn import viz, widgets
    from tpattn.viz import heads, layers, sharding, style, tables
    from tpattn.widgets import explorers, kv

    assert viz.heads_layout is heads.heads_layout and viz.rope_rotation_figure is layers.rope_rotation_figure
    assert viz.use_book_style is style.use_book_style and viz.replica_groups_layout is heads.replica_groups_layout
    assert widgets.heads_explorer is kv.heads_explorer and widgets.kv_caption is kv.kv_caption
    assert viz.format_measure is tables.format_measure and viz.matrix_figure is sharding.matrix_figure
    assert widgets.rope_explorer is explorers.rope_explorer and viz.sharding is sharding
    assert {"format_measure", "heads_layout", "replica_groups_figure"} <= set(viz.__all__)
    assert {"Explorer", "kv_explorer", "sp_explorer", "rope_explorer"} <= set(widgets.__all__)
    with pytest.raises(AttributeError, match="no attribute 'no_such_figure'"):
        viz.no_such_figure


# --- the check itself -------------------------------------------------------------------------

def test_passes_at_the_bound_and_raises_just_above_it():
    # float64 and powers of two: every difference below is exact
    atol, rtol = 2.0 ** -20, 2.0 ** -20
    zero = torch.zeros(4, dtype=torch.float64)
    assert_close_within(zero + atol, zero, rtol=0, atol=atol)
    with pytest.raises(AssertionError):
        assert_close_within(zero + atol + 2.0 ** -40, zero, rtol=0, atol=atol)
    one = torch.ones(4, dtype=torch.float64)
    assert_close_within(one + rtol, one, rtol=rtol, atol=0)
    with pytest.raises(AssertionError):
        assert_close_within(one + rtol + 2.0 ** -40, one, rtol=rtol, atol=0)
    # float32 at the book's 1e-6: a difference of 2e-6 fails, 5e-7 passes
    x = torch.linspace(-1, 1, 64)
    assert_close_within(x + 5e-7, x, rtol=0, atol=1e-6)
    with pytest.raises(AssertionError):
        assert_close_within(x + 2e-6, x, rtol=0, atol=1e-6)


def test_the_message_says_what_where_and_by_how_much():
    expected = torch.zeros(2, 3, 4)
    actual = expected.clone()
    actual[1, 2, 3] = 0.5
    actual[0, 0, 0] = 1e-3
    with pytest.raises(AssertionError) as failure:
        assert_close_within(actual, expected, rtol=0, atol=1e-6, what="dX")
    message = str(failure.value)
    assert message.startswith("dX: 2 of 24 elements differ")
    assert "atol=1e-06, rtol=0" in message
    assert "the largest of them, |actual - expected| = 5.000e-01 at index [1, 2, 3]" in message


def test_the_message_points_at_a_failing_element():
    # with rtol, the largest gap (at a large value) passes; the reported one must fail
    expected = torch.tensor([1000.0, 0.0], dtype=torch.float64)
    actual = torch.tensor([1000.5, 0.01], dtype=torch.float64)
    with pytest.raises(AssertionError) as failure:
        assert_close_within(actual, expected, rtol=1e-3, atol=1e-6)
    assert "1 of 2" in str(failure.value) and "at index [1]" in str(failure.value)


def test_nan_never_matches():
    with pytest.raises(AssertionError, match="1 of 2"):
        assert_close_within(torch.tensor([0.0, float("nan")]), torch.tensor([0.0, float("nan")]),
                            rtol=1, atol=1)


@pytest.mark.parametrize("call, field", [
    (lambda: assert_close_within(torch.ones(2), torch.ones(3), rtol=0, atol=0), "shape"),
    (lambda: assert_close_within(torch.ones(2), torch.ones(2).double(), rtol=0, atol=0), "dtype"),
    (lambda: assert_close_within([1.0], torch.ones(1), rtol=0, atol=0), "actual"),
    (lambda: assert_close_within(torch.ones(1), torch.ones(1), rtol=-1, atol=0), "rtol"),
    (lambda: assert_close_within(torch.ones(1), torch.ones(1), rtol=0, atol=float("inf")),
     "atol"),
])
def test_bad_input_is_a_value_error_naming_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_tolerances_are_required():
    with pytest.raises(TypeError):
        assert_close_within(torch.ones(1), torch.ones(1))  # type: ignore[call-arg]


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-2, 2, width=32), min_size=1, max_size=8),
       shifts=st.lists(st.sampled_from([0.0, 1e-7, 1e-6, 2e-6, 1e-5, 1e-3]), min_size=8,
                       max_size=8),
       tolerance=st.sampled_from([(0.0, 1e-6), (1e-6, 0.0), (1.3e-6, 1e-5), (0.0, 0.0)]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_agrees_with_torch_testing_assert_close(values, shifts, tolerance, dtype):
    rtol, atol = tolerance
    expected = torch.tensor(values, dtype=dtype)
    actual = expected + torch.tensor(shifts[:len(values)], dtype=dtype)
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
        theirs = True
    except AssertionError:
        theirs = False
    try:
        assert_close_within(actual, expected, rtol=rtol, atol=atol)
        ours = True
    except AssertionError:
        ours = False
    assert ours == theirs


def test_exported_from_the_package():
    assert tpattn.assert_close_within is assert_close_within
    assert "assert_close_within" in tpattn.__all__
