"""The gradient-flow diagrams of chapters 5 and 7 (tpattn.viz.overview) draw what their
docstrings say: one lane per rank, f's sum of dn, dX never all-reduced."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import tpattn  # noqa: E402
from tpattn import viz  # noqa: E402


def texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


@pytest.mark.parametrize("cfg", [tpattn.Config(),
                                 tpattn.Config(query_heads=8, kv_heads=4, world_size=4),
                                 tpattn.Config(query_heads=6, kv_heads=3, world_size=3)])
def test_backward_flow_has_one_lane_and_one_dn_per_rank(cfg):
    fig = viz.backward_flow_figure(cfg)
    shown = texts(fig)
    lanes = [t for t in shown if t.startswith("rank ")]
    assert len(lanes) == cfg.world_size
    assert [t for t in shown if t.startswith("dn_")] == [f"dn_{r}" for r in range(cfg.world_size)]
    assert "dn = Σ dn_r" in shown and "dX" in shown
    assert any("never all-reduced" in t for t in shown)
    assert f"{cfg.world_size} ranks" in fig.axes[0].get_title()
    plt.close(fig)


def test_gradient_paths_show_both_paths_and_where_f_sums():
    fig = viz.gradient_paths_figure()
    shown = texts(fig)
    assert {"x", "y", "dX", "dy", "dn"} <= set(shown)
    assert "dy, through the residual" in shown and "through the branch" in shown
    assert any("f sums dn" in t for t in shown)
    plt.close(fig)
