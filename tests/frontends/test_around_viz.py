"""The figures of chapter 17, "Around the block" (``tpattn.viz.around_mesh``,
``tpattn.viz.around_model``): each draws what its caption says. (The chapter itself runs
under nbval: every claim it prints is asserted in a cell.)"""
import matplotlib
import pytest

from tpattn import Config
from tpattn.parallel.injection import Injection
from tpattn.viz.around_model import (dropout_masks_figure, qk_norm_drift_figure,
                                     qk_norm_replica_drift, residual_masks_by_rank)

matplotlib.use("Agg")


def test_mesh_figures_draw_the_groups_they_say():
    import matplotlib.pyplot as plt

    from tpattn.config import Config
    from tpattn.viz.around_mesh import (gathered_sources, mesh_groups_figure, mesh_panels,
                                        sp_gather_figure)

    cfg = Config(data_parallel=2)
    panels = {p["mode"]: p for p in mesh_panels(cfg)}
    assert panels["loss_reduced_over_world"]["wrong"] == [[0, 1, 2, 3]]
    assert panels["dp_grad_group_of_one"]["wrong"] == [[0], [1], [2], [3]]
    assert all(p["right"] == [[0, 2], [1, 3]] for p in panels.values())
    sp = Config(data_parallel=2, sequence_parallel=True, seq=4)
    assert gathered_sources(sp, "tp")[2] == [(1, 0), (1, 1)]
    assert gathered_sources(sp, "dp")[2] == [(0, 0), (1, 0)]
    assert len(mesh_groups_figure(cfg).axes) == 6
    assert len(sp_gather_figure(sp).axes) == 2
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
