"""Every script in bench/ runs with ``--smoke`` and prints its figures (``make bench`` runs
them at full size; these runs take seconds each).

Each script is run in a subprocess on this tree's ``tpattn`` (``PYTHONPATH``), and its output
must match the patterns in ``FIGURES``: a label and the number after it. Scripts are found
by globbing ``bench/*.py``, so a new script fails here until it has ``--smoke`` and patterns.
``speed.py --smoke`` runs the scripts of ``VIA_SPEED`` with ``--smoke`` itself, their output
in its own: their patterns are matched there, not in a run of their own. One test class per
run: ``make test``'s ``--dist loadscope`` hands out whole classes, so the runs spread over
the workers.
"""
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
TIMEOUT_S = 240
#: The scripts ``speed.py`` runs (each announced by a ``-- NAME --smoke`` line).
VIA_SPEED = ("book_build.py", "test_time.py", "widget_latency.py", "notebook_imports.py")
NUMBER = r"\d+\.\d+"

#: What each script's ``--smoke`` prints: one regex per line that must appear.
FIGURES = {
    "book_build.py": [rf"serial jupyter execute, 1 notebooks: +{NUMBER} s wall +{NUMBER} s CPU"],
    "cli_vs_seed.py": [rf"tpattn: median {NUMBER} s"],
    "diagnosis_tiers.py": [r"all: 2 cases: right \d+, tied \d+, blind \d+, missed \d+, wrong \d+",
                           r"two bugs at once, tier 2: 1 cases; both named \d/1",
                           r"made-up bugs, tier 2: \w"],
    "llama_shape.py": [rf"check: {NUMBER} s +check/floor: {NUMBER}",
                       rf"peak memory: dense step \d+ MiB, check \d+ MiB, ratio {NUMBER}"],
    "lm_envelope.py": [rf"smoke: correct TP max div/env {NUMBER}; rounding 2, inconclusive 0, "
                       r"bug 0 of 2",
                       r"smoke: bugs min div/env \d+\.\d+; judged bug (\d+)/\1, the latest "
                       r"from step \d+; called rounding 0"],
    "notebook_imports.py": [rf"smoke\.ipynb +{NUMBER} +{NUMBER}"],
    "notebook_times.py": [rf"smoke\.ipynb +{NUMBER} s"],
    "omp_wait.py": [rf"OMP_WAIT_POLICY=\(unset\) +wall +{NUMBER} s +CPU +{NUMBER} s",
                    rf"OMP_WAIT_POLICY=PASSIVE +wall +{NUMBER} s +CPU +{NUMBER} s"],
    "reading_load.py": [r"book/01_fixture\.ipynb +\d+ +\d+ +\d+ +\d+ +\d+",
                        r"code \+ shown source: \d+ lines"],
    "real_ranks.py": [rf"run_distributed\(2\), one seed, every mode: startup {NUMBER} s",
                      rf"run_matrix\(\) in-process: {NUMBER} s"],
    "speed.py": [r"1\. cold make book / serial execute: not measured \(- / \d+ s",
                 rf"2\. make test, warm venv: {NUMBER} min",
                 r"3\. explorer redraw p95, worst: \d+ ms wall, \d+ ms CPU",
                 r"4\. notebooks importing a heavy module they do not use: \d+"],
    "test_time.py": [rf"pytest on one generated test .*: +{NUMBER} s wall, pytest {NUMBER} s "
                     r"\(1 tests\)"],
    "tolerance_headroom.py": [rf"correct TP n=1 measure/bound median {NUMBER}",
                              r"correct TP over the C=1 bound: \d/1"],
    "tolerance_sweep.py": [rf"float32: 4 TP steps; correct TP measure/bound max {NUMBER}, "
                           r"bugs min \d",
                           rf"float32 dense against float64: measure/bound max {NUMBER}"],
    "widget_latency.py": [rf"^{re.escape(name)} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}"
                          for name in ("rope (ch 3)", "attention (ch 4)", "sharding (ch 6)",
                                       "seed x mode (ch 8-10)", "seed x SP mode (ch 12)",
                                       "kv (ch 13)", "bug hunt (ch 17)")],
}


def run_bench(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python bench/<script> args...`` on this tree's package; its exit status and output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def assert_figures(script: str, stdout: str) -> None:
    """``stdout`` has a line matching each of ``FIGURES[script]``."""
    assert script in FIGURES, f"bench/{script}: give it --smoke and add what it prints to FIGURES"
    for pattern in FIGURES[script]:
        assert re.search(pattern, stdout, re.M), (
            f"bench/{script} --smoke printed no line matching {pattern!r}:\n{stdout[-3000:]}")


class SmokeRun:
    """Runs ``script`` with ``--smoke``: exit status 0 and every line of ``FIGURES``."""

    script = ""

    def test_smoke_run_prints_its_figures(self):
        done = run_bench(self.script, "--smoke")
        assert done.returncode == 0, (
            f"bench/{self.script} --smoke exited {done.returncode}:\n{done.stderr[-3000:]}")
        assert_figures(self.script, done.stdout)
        if self.script == "speed.py":
            ran = re.findall(r"^-- (\S+) --smoke$", done.stdout, re.M)
            assert sorted(ran) == sorted(VIA_SPEED), ran
            for script in ran:
                assert_figures(script, done.stdout)


for _script in SCRIPTS:
    if _script not in VIA_SPEED:
        _name = "TestSmoke_" + _script.removesuffix(".py")
        globals()[_name] = type(_name, (SmokeRun,), {"script": _script})


def test_every_figure_pattern_names_a_bench_script():
    assert SCRIPTS and set(FIGURES) <= set(SCRIPTS), set(FIGURES) - set(SCRIPTS)


class TestWidgetLatencyBefore:
    def test_a_revision_it_cannot_time_is_one_line_and_exit_0(self):
        done = run_bench("widget_latency.py", "--smoke", "--only", "sharding",
                         "--before", "no-such-revision")
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [line for line in done.stdout.splitlines() if "not timed" in line]
        assert len(lines) == 1 and "no-such-revision" in lines[0], done.stdout
        assert re.search(rf"^sharding \(ch 6\) +{NUMBER}", done.stdout, re.M), done.stdout
