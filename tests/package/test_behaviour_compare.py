"""tools/behaviour_compare.py on tiny synthetic dumps: bit-identical floats where an entry
says ``bits``, the rounding bound where it says ``bound``, everything else exact."""
from __future__ import annotations

import copy
import importlib.util
import json
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_tool():
    spec = importlib.util.spec_from_file_location("behaviour_compare",
                                                  ROOT / "tools" / "behaviour_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()
RHO = 7e-7
BOUND = 2e-6  # the forward measure's auto bound in this made-up dump


def measures(fwd: float, passed: bool, mode: str = "equivalence") -> dict:
    return {"seed": 11, "mode": mode, "forward_max_abs_diff": fwd, "loss_abs_diff": 0.0,
            "passed": passed}


def dump() -> dict:
    bound = {"rtol": RHO, "atol": {"*": RHO, "forward_max_abs_diff": BOUND},
             "rel_under": ["bounds", "floors"]}
    return {"format": tool.FORMAT, "header": {"commit": "x"}, "entries": {
        "run|{}|equivalence|seed=11|fixture": {
            "kind": "run", "floats": "bits", "value": measures(1.1920928955078125e-07, True)},
        "run|{}|missing_output_reduce|seed=11|ranks": {
            "kind": "run", "floats": "bound", **bound,
            "value": measures(0.75, False, "missing_output_reduce")},
        "run_auto|{}|equivalence|seed=1|ranks": {
            "kind": "run_auto", "floats": "bound", **bound,
            "value": {**measures(1e-7, True), "bounds": {"forward_max_abs_diff": 1e-6},
                      "verdict": "pass"}},
        "run|{}|nope|seed=1|fixture": {
            "kind": "run", "floats": "bound", **bound,
            "value": {"error": "ValueError", "message": "mode must be one of a, b (got 'nope')"}},
        "exercise|check_g|solution": {
            "kind": "exercise", "floats": "bits",
            "value": {"passed": True, "message": "forward sums, backward is the identity"}},
        "cli|python -m tpattn": {
            "kind": "cli", "floats": "bits",
            "value": {"argv": [], "exit": 0, "stderr": "",
                      "stdout": json.dumps(measures(1.1920928955078125e-07, True), indent=2)}},
        "cli|python -m tpattn --simulate ranks": {
            "kind": "cli", "floats": "bound", **bound,
            "value": {"argv": ["--simulate", "ranks"], "exit": 0, "stderr": "",
                      "stdout": json.dumps(measures(1.2e-07, True), indent=2)}},
    }}


def changed(key: str, edit) -> dict:
    after = copy.deepcopy(dump())
    edit(after["entries"][key]["value"])
    return tool.compare(dump(), after)


def test_a_dump_equals_itself_and_counts_every_entry():
    result = tool.compare(dump(), dump())
    assert result["ok"] and result["differences"] == []
    assert result["compared"] == 7 and result["bounded_not_bits"] == 0


def test_a_fixture_entry_must_stay_bit_for_bit():
    key = "run|{}|equivalence|seed=11|fixture"
    one_ulp = math.nextafter(1.1920928955078125e-07, 1.0)
    result = changed(key, lambda v: v.update(forward_max_abs_diff=one_ulp))
    assert not result["ok"]
    assert result["differences"][0][0] == key and "forward_max_abs_diff" in result["differences"][0][1]


def test_the_default_cli_output_must_stay_text_for_text():
    key = "cli|python -m tpattn"
    # the same JSON, indented differently: still a change of the seed's output
    result = changed(key, lambda v: v.update(stdout=json.dumps(json.loads(v["stdout"]))))
    assert not result["ok"] and result["differences"][0][0] == key


@pytest.mark.parametrize("delta, ok", [(2 * BOUND + 0.5 * RHO * 0.75, True),  # in 2 atol + rtol|x|
                                       (2 * BOUND + 2 * RHO * 0.75, False)])  # outside
def test_a_ranks_entry_agrees_within_atol_plus_rtol(delta, ok):
    key = "run|{}|missing_output_reduce|seed=11|ranks"
    result = changed(key, lambda v: v.update(forward_max_abs_diff=0.75 + delta))
    assert result["ok"] is ok, result["differences"]
    if ok:
        assert result["bounded_not_bits"] == 1


def test_a_float_without_its_own_bound_gets_rho_only():
    key = "run|{}|missing_output_reduce|seed=11|ranks"
    assert changed(key, lambda v: v.update(loss_abs_diff=0.5 * RHO))["ok"]
    assert not changed(key, lambda v: v.update(loss_abs_diff=2 * RHO))["ok"]


def test_a_bound_is_compared_relatively_not_with_the_measures_atol():
    key = "run_auto|{}|equivalence|seed=1|ranks"
    # 1e-6 -> 2e-6 is within the forward measure's atol (4e-6) but is a 100% change of a bound
    result = changed(key, lambda v: v["bounds"].update(forward_max_abs_diff=2e-6))
    assert not result["ok"] and ".bounds.forward_max_abs_diff" in result["differences"][0][1]


def test_a_bounded_cli_output_is_compared_as_json():
    key = "cli|python -m tpattn --simulate ranks"
    near = changed(key, lambda v: v.update(
        stdout=json.dumps(measures(1.2e-07 + 1e-7, True), indent=2)))
    assert near["ok"], near["differences"]
    flipped = changed(key, lambda v: v.update(
        stdout=json.dumps(measures(1.2e-07, False), indent=2)))
    assert not flipped["ok"] and ".stdout.passed" in flipped["differences"][0][1]


@pytest.mark.parametrize("key, edit", [
    ("run|{}|missing_output_reduce|seed=11|ranks", lambda v: v.update(passed=True)),
    ("run_auto|{}|equivalence|seed=1|ranks", lambda v: v.update(verdict="inconclusive")),
    ("run|{}|nope|seed=1|fixture", lambda v: v.update(message="mode must be one of a, b")),
    ("exercise|check_g|solution", lambda v: v.update(message="forward sums.")),
    ("run|{}|missing_output_reduce|seed=11|ranks", lambda v: v.update(seed=11.0)),
    ("cli|python -m tpattn --simulate ranks", lambda v: v.update(exit=1)),
    ("run|{}|missing_output_reduce|seed=11|ranks", lambda v: v.pop("passed")),
], ids=["pass-flag", "verdict", "error-message", "exercise-message", "int-to-float",
        "exit-code", "missing-key"])
def test_everything_but_a_float_is_compared_exactly(key, edit):
    result = changed(key, edit)
    assert not result["ok"] and {k for k, _ in result["differences"]} == {key}


def test_a_missing_or_new_entry_is_a_difference():
    after = dump()
    del after["entries"]["exercise|check_g|solution"]
    after["entries"]["exercise|check_f|solution"] = dump()["entries"]["exercise|check_g|solution"]
    lines = dict(tool.compare(dump(), after)["differences"])
    assert lines == {"exercise|check_g|solution": "missing in AFTER",
                     "exercise|check_f|solution": "new in AFTER"}


def test_nan_equals_only_nan():
    assert tool.float_agrees(math.nan, math.nan, 0.1, 0.1)
    assert not tool.float_agrees(math.nan, 0.0, 0.1, 0.1)
    assert not tool.float_agrees(math.inf, 1e308, 0.1, 0.1)


def test_the_command_exits_0_when_same_1_when_changed_2_on_bad_input(tmp_path, capsys):
    before, after, bad = tmp_path / "b.json", tmp_path / "a.json", tmp_path / "bad.json"
    before.write_text(json.dumps(dump()))
    other = dump()
    other["entries"]["exercise|check_g|solution"]["value"]["passed"] = False
    after.write_text(json.dumps(other))
    bad.write_text(json.dumps({"format": "something else"}))
    assert tool.main([str(before), str(before)]) == 0
    assert "SAME" in capsys.readouterr().out
    assert tool.main([str(before), str(after)]) == 1
    out = capsys.readouterr().out
    assert "CHANGED" in out and "exercise|check_g|solution: .passed: True != False" in out
    assert tool.main([str(before), str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("behaviour_compare: error: after must be a dump") and err.count("\n") == 1


def test_dumps_made_under_other_cpu_kernels_are_flagged(tmp_path, capsys):
    before, after = dump(), dump()
    before["header"]["env"] = {"ATEN_CPU_CAPABILITY": None}
    after["header"]["env"] = {"ATEN_CPU_CAPABILITY": "default"}
    paths = [tmp_path / "b.json", tmp_path / "a.json"]
    for path, d in zip(paths, (before, after)):
        path.write_text(json.dumps(d))
    assert tool.main([str(p) for p in paths]) == 0  # the entries agree; the warning stays
    assert "WARNING: the dumps were made under other CPU kernels" in capsys.readouterr().out


def test_measured_rounding_noise_is_not_compared_but_its_verdict_is():
    key = "run_auto|{}|equivalence|seed=1|ranks"
    assert changed(key, lambda v: v.update(amplification=300.0))["ok"] is False  # new key
    before, after = dump(), dump()
    for d, amp in ((before, 3.0), (after, 250.0)):
        d["entries"][key]["value"]["amplification"] = amp
    assert tool.compare(before, after)["ok"]
