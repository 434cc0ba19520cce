"""tpattn.viz.loss_curves: one panel per setting, the gap in its title, bad input refused."""
from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

from tpattn.viz.loss_curves import final_gap, loss_curves_figure  # noqa: E402


def test_final_gap_is_relative_to_the_reference_last_loss():
    assert final_gap([3.0, 1.1], [3.0, 1.0]) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="reference"):
        final_gap([1.0], [0.0])
    with pytest.raises(ValueError, match="at least one step"):
        final_gap([], [1.0])


def test_one_panel_per_setting_with_the_gap_in_its_title():
    fig = loss_curves_figure({"1 block": {"correct": [2.0, 1.0], "bug": [2.0, 1.0]},
                              "8 blocks": {"correct": [2.0, 1.0], "bug": [2.0, 1.2]}})
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["1 block (last step: 0.0% apart)", "8 blocks (last step: 20.0% apart)"]
    assert [len(ax.get_lines()) for ax in fig.axes] == [2, 2]


def test_empty_panels_are_refused():
    with pytest.raises(ValueError, match="panels"):
        loss_curves_figure({})
    with pytest.raises(ValueError, match="panels"):
        loss_curves_figure({"1 block": {}})
