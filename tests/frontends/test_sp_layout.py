"""Chapter 12's SP layout figure names each collective as this book, Megatron-LM, the paper and
the Playbook do, in the order the block runs them."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from tpattn.parallel.collectives import GatherSequence, ScatterSequence  # noqa: E402
from tpattn.viz.sp_layout import SP_COLLECTIVE_NAMES, sp_layout_figure  # noqa: E402


def test_the_figure_names_both_collectives_left_to_right():
    fig = sp_layout_figure()
    texts = sorted((t.get_position()[0], t.get_text()) for t in fig.axes[0].texts)
    joined = " | ".join(text for _, text in texts)
    gather = joined.index("gather_from_sequence_parallel_region")
    scatter = joined.index("reduce_scatter_to_sequence_parallel_region")
    assert gather < scatter
    assert "fwd: all-gather\nbwd: reduce-scatter" in joined
    assert "fwd: reduce-scatter\nbwd: all-gather" in joined
    assert "Playbook: g*" in joined
    plt.close(fig)


def test_the_names_are_the_package_functions():
    assert SP_COLLECTIVE_NAMES["gather"][0] == GatherSequence.__name__
    assert SP_COLLECTIVE_NAMES["scatter"][0] == ScatterSequence.__name__
