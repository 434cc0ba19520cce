"""The drafts of chapter "Around the block" on dropout and qk-norm
(``book/_drafts/around_dropout.py``, ``around_qknorm.py``) run top to bottom: every claim
they print is asserted in a cell, and their figures (``tpattn.viz.around_model``) draw."""
import re
from pathlib import Path

import matplotlib
import pytest

from tpattn import Config
from tpattn.parallel.injection import Injection
from tpattn.viz.around_model import (dropout_masks_figure, qk_norm_drift_figure,
                                     qk_norm_replica_drift, residual_masks_by_rank)

DRAFTS = Path(__file__).resolve().parents[2] / "book" / "_drafts"


def code_cells(path: Path) -> list[str]:
    src = path.read_text()
    heads = re.findall(r"^# %%.*$", src, flags=re.M)
    bodies = re.split(r"^# %%.*$", src, flags=re.M)[1:]
    return [b for h, b in zip(heads, bodies) if "[markdown]" not in h]


@pytest.mark.parametrize("name", ["around_dropout.py", "around_qknorm.py"])
def test_the_draft_runs_and_its_cells_fit_the_column(name, monkeypatch):
    import matplotlib.pyplot as plt

    matplotlib.use("Agg")
    monkeypatch.setattr(plt, "show", lambda: None)
    namespace = {"__name__": "reader"}
    for i, cell in enumerate(code_cells(DRAFTS / name)):
        lines = cell.strip("\n").split("\n")
        assert len(lines) <= 40, (name, i)
        assert all(len(line) <= 77 for line in lines), (name, i)
        exec(compile(cell, f"<{name} cell {i}>", "exec"), namespace)
        if cell.strip().startswith("exercises."):
            result = eval(cell.strip(), namespace)
            assert result.passed == ("NotImplementedError" not in repr(result)), result
    plt.close("all")


def test_the_masks_figure_shows_rank_0_apart_only_under_the_drift():
    cfg = Config(dropout=0.1)
    synced = residual_masks_by_rank(cfg, 11, Injection())
    drifted = residual_masks_by_rank(cfg, 11, Injection(rng="rank0_drift"))
    assert (synced[0] == synced[1]).all() and (drifted[1] == synced[1]).all()
    assert not (drifted[0] == drifted[1]).all()
    fig = dropout_masks_figure(cfg)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["rank 0: = rank 1", "rank 1: = rank 1",
                      "rank 0: ≠ rank 1", "rank 1: = rank 1"]


def test_the_qk_norm_drift_grows_only_without_the_reduce():
    cfg = Config(qk_norm=True)
    bug = qk_norm_replica_drift(cfg, 11, Injection(qk_norm_grad="none"), 4)
    good = qk_norm_replica_drift(cfg, 11, Injection(), 4)
    assert good == [0.0] * 4 and all(b > a > 0 for a, b in zip(bug, bug[1:]))
    assert len(qk_norm_drift_figure(cfg, steps=3).axes[0].lines) == 2
    with pytest.raises(ValueError, match="qk_norm must be True"):
        qk_norm_replica_drift(Config(), 11, Injection(), 1)
