"""``torchrun -m tpattn.distributed --model lm --mode matrix`` at TP 2 prints ``python -m tpattn
--model lm --mode matrix``'s JSON, and so does ``python -m tpattn.distributed`` (ranks it
starts itself): the same runs, verdicts and failed measures, the measures
equal within rounding (measured on gloo: bit for bit); bad LM input exits 2 with one line
before any process starts; ``--list-modes`` is the LM registry. One torchrun launch of one
seed (measured 16 s alone, 24 s under a load of 5 on two cores: three processes importing torch),
started first so it runs while the simulated JSON is computed."""
import contextlib
import io
import json
import subprocess
import sys

import pytest

from tpattn.bugs.lm_zoo import LM_REGISTRY
from tpattn.check.measures import MEASURES
from tpattn.cli import main as cli_main
from tpattn.distributed import distributed_main

from tests.conftest import ROOT
from tests.real.test_distributed import _torchrun

pytestmark = pytest.mark.timeout(300)

ARGS = ["--model", "lm", "--layers", "2", "--mode", "matrix", "--seeds", "11"]
TORCHRUN = _torchrun() + ["--standalone", "--nproc-per-node", "2", "-m", "tpattn.distributed",
                          *ARGS, "--world-size", "2", "--timeout", "60"]


@pytest.fixture(scope="module")
def torchrun():
    """The torchrun launch, started now; calling it waits for ``(exit code, stdout, stderr)``."""
    proc = subprocess.Popen(TORCHRUN, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)

    def wait():
        out, err = proc.communicate(timeout=240)
        return proc.returncode, out, err

    yield wait
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def simulated():
    """``python -m tpattn``'s JSON of ``ARGS`` (simulated ranks)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(ARGS) == 0
    return json.loads(out.getvalue())


def assert_same_json(real: list[dict], simulated: list[dict]) -> None:
    """The same runs, keys, verdicts and failed measures; the measures within rounding."""
    assert [(r["mode"], r["seed"]) for r in real] == [
        (mode, seed) for mode in LM_REGISTRY for seed in (11,)]
    for r, s in zip(real, simulated):
        assert list(r) == list(s)
        assert (r["verdict"], r["failed"]) == (s["verdict"], s["failed"]), r["mode"]
        assert tuple(r["failed"]) == LM_REGISTRY[r["mode"]].fails
        for m in MEASURES:
            assert r[m] == pytest.approx(s[m], rel=1e-4, abs=s["bounds"][m]), (r["mode"], m)


def test_torchrun_prints_the_simulated_lm_json(torchrun, simulated):
    code, out, err = torchrun()
    assert code == 0, err[-2000:]
    assert_same_json(json.loads(out), simulated)  # rank 0 alone prints: one JSON document


def test_self_started_ranks_print_the_simulated_lm_json(torchrun, simulated, capsys):
    torchrun()  # one launch at a time on a small machine
    assert distributed_main(ARGS, prog="tpattn.distributed") == 0
    assert_same_json(json.loads(capsys.readouterr().out), simulated)


@pytest.mark.parametrize("argv, needle", [
    (["--vocab", "31"], "vocab must be a multiple of block.world_size"),
    (["--sequence-parallel", "--seq", "4"], "block.sequence_parallel must be False"),
    (["--mode", "missing_output_reduce"], "mode must be matrix or one of the LM's modes"),
    (["--diagnose"], "--diagnose with --model lm observes simulated ranks"),
])
def test_bad_lm_input_on_real_ranks_is_one_line_and_exit_2(capsys, argv, needle):
    assert distributed_main(["--model", "lm", *argv], prog="tpattn.distributed") == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and needle in err, err


def test_list_modes_on_real_ranks_is_the_lm_registry(capsys):
    assert distributed_main(["--model", "lm", "--list-modes"]) == 0
    assert json.loads(capsys.readouterr().out) == [m.as_dict() for m in LM_REGISTRY.values()]
