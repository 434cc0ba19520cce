"""How long `make test` takes with a warm venv, and where the time goes (issue 15, figure 2).

Runs ``make test`` (pytest with nbval on every core, the book build from nbval's executions,
pytest on the built HTML) with JUnit reports (``JUNIT=``), and prints the wall time, the
pytest part of it, and the test seconds summed by group (nbval per notebook, the browser
test, the distributed tests, the rest). Under pytest-xdist the group
sums are worker seconds, so they add up to more than the wall time. Target: <= 6 min on 2
cores. The book is built from an empty execution cache (``_build/.jupyter_cache`` is moved
aside and put back), as on a fresh clone. Then it times ``make test-lab`` (every chapter in a
real JupyterLab; CI runs it after ``make test``, ``make test`` does not) unless ``--no-lab``.

``--ci`` instead clones this repository into a temporary folder (with ``../shared`` beside it,
as CI has it) and times ``bash .ci/run`` there: fresh venv, cold book, ``make test`` and
``make test-portable``. Target: <= 20 min. It takes about that long.

A benchmark, not a test: exit status 0 unless the timed command fails. ``--json PATH`` writes
the figures.

``--smoke`` times pytest on a generated one-test module in a temporary folder (plugins not
loaded) through the same JUnit report and grouping instead (a second): no ``make test``, no
book, no lab.

    .venv/bin/python bench/test_time.py [--ci] [--json PATH] [--smoke]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_TEST_S = 6 * 60
TARGET_CI_S = 20 * 60
#: The module ``--smoke`` runs.
SMOKE_TEST = "def test_one_plus_one():\n    assert 1 + 1 == 2\n"


def group_of(classname: str, name: str) -> str:
    """A JUnit test case's group: what the time is spent on."""
    path = classname.replace(".", "/")
    if "ipynb" in path or "ipynb" in name:
        return "nbval (every notebook)"
    for key, label in (("test_browser", "browser (built HTML)"),
                       ("test_distributed", "real ranks (torchrun)"),
                       ("test_sequence_parallel", "sequence parallel"),
                       ("test_properties", "property tests"),
                       ("test_rederive", "property tests"),
                       ("test_tolerance", "property tests")):
        if key in path:
            return label
    return "other unit tests"


def junit_suite(path: str) -> ET.Element:
    """The ``<testsuite>`` of a pytest JUnit report (the root, or the root's first child)."""
    root = ET.parse(path).getroot()
    return root if root.tag == "testsuite" else root.find("testsuite")


def make_test(args) -> dict:
    cache = ROOT / "_build" / ".jupyter_cache"
    with tempfile.TemporaryDirectory() as tmp:
        aside = Path(tmp) / "jupyter_cache"
        if cache.exists():
            cache.rename(aside)
        try:
            junit = Path(tmp) / "junit"
            t0 = time.perf_counter()
            subprocess.run(["make", "test", f"JUNIT={junit}"], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
        finally:
            if aside.exists():
                shutil.rmtree(cache, ignore_errors=True)
                aside.rename(cache)
        groups = collections.Counter()
        pytest_s, tests = 0.0, 0
        for part in ("1", "3"):
            suite = junit_suite(f"{junit}-{part}.xml")
            pytest_s += float(suite.get("time"))
            tests += int(suite.get("tests"))
            for case in suite.iter("testcase"):
                groups[group_of(case.get("classname", ""), case.get("name", ""))] += float(
                    case.get("time", 0))
    figures = {"make_test_s": round(wall, 1), "pytest_s": round(pytest_s, 1),
               "groups_s": {k: round(v, 1) for k, v in groups.items()}, "cpus": os.cpu_count()}
    print(f"make test (warm venv): {wall:6.1f} s wall (target <= {TARGET_TEST_S} s): "
          f"{'PASS' if wall <= TARGET_TEST_S else 'OVER'}  [{os.cpu_count()} CPUs]")
    print(f"  book build {wall - pytest_s:6.1f} s, pytest {pytest_s:6.1f} s "
          f"({tests} tests); test seconds by group:")
    for name, seconds in groups.most_common():
        print(f"    {name:<30} {seconds:7.1f} s")
    if args.lab:
        with tempfile.TemporaryDirectory() as tmp:
            junit = Path(tmp) / "junit"
            t0 = time.perf_counter()
            subprocess.run(["make", "test-lab", f"JUNIT={junit}"], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)
            lab_wall = time.perf_counter() - t0
            suite = junit_suite(f"{junit}-lab.xml")
            lab_worker_s = sum(float(c.get("time", 0)) for c in suite.iter("testcase"))
        figures.update(test_lab_s=round(lab_wall, 1), test_lab_worker_s=round(lab_worker_s, 1))
        print(f"make test-lab (CI runs it after make test): {lab_wall:6.1f} s wall, "
              f"{lab_worker_s:.1f} worker-seconds ({suite.get('tests')} tests)")
    return figures


def smoke() -> dict:
    """pytest on a one-test module (``SMOKE_TEST``) with a JUnit report: its times, groups."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "test_smoke.py").write_text(SMOKE_TEST)
        junit = Path(tmp) / "junit.xml"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={junit}", "test_smoke.py"], cwd=tmp, check=True,
                       stdout=subprocess.DEVNULL, env=dict(
                           os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTEST_ADDOPTS=""))
        wall = time.perf_counter() - t0
        suite = junit_suite(str(junit))
        groups = collections.Counter()
        for case in suite.iter("testcase"):
            groups[group_of(case.get("classname", ""), case.get("name", ""))] += float(
                case.get("time", 0))
    print(f"pytest on one generated test (smoke, not make test): {wall:6.1f} s wall, pytest "
          f"{float(suite.get('time')):.1f} s ({suite.get('tests')} tests)")
    for name, seconds in groups.most_common():
        print(f"    {name:<30} {seconds:7.1f} s")
    return {"make_test_s": round(wall, 1), "pytest_s": round(float(suite.get("time")), 1),
            "groups_s": {k: round(v, 1) for k, v in groups.items()}, "cpus": os.cpu_count(),
            "smoke": True}


def ci_run(args) -> dict:
    shared = ROOT.parent / "shared"
    with tempfile.TemporaryDirectory(prefix="tpattn-ci-") as tmp:
        clone = Path(tmp) / "repo"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        if shared.exists():
            (Path(tmp) / "shared").symlink_to(shared)
        t0 = time.perf_counter()
        subprocess.run(["bash", ".ci/run"], cwd=clone, check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, CI="true"))
        wall = time.perf_counter() - t0
    print(f"bash .ci/run from a fresh clone: {wall / 60:5.1f} min (target <= "
          f"{TARGET_CI_S // 60} min): {'PASS' if wall <= TARGET_CI_S else 'OVER'}  "
          f"[{os.cpu_count()} CPUs]")
    return {"ci_run_s": round(wall, 1), "cpus": os.cpu_count()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ci", action="store_true", help="time .ci/run in a fresh clone")
    parser.add_argument("--no-lab", dest="lab", action="store_false",
                        help="do not time make test-lab after make test")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--smoke", action="store_true",
                        help="time pytest on one generated test only: checks the script runs")
    args = parser.parse_args()
    figures = smoke() if args.smoke else ci_run(args) if args.ci else make_test(args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
