"""tpattn.viz.around_loading: the rows every rank loads under each loader, decoded from the
package's own loader (``check.core.shard``), and the figure that draws them."""
import pytest

from tpattn import Config
from tpattn.viz.around_loading import loaded_heads

CFG = Config(query_heads=8, kv_heads=4)  # two KV groups per rank


def test_correct_loaders_give_every_rank_its_own_heads():
    for layout in ("heads", "fused", "grouped"):
        ranks = loaded_heads(CFG, layout)
        assert all(right for heads in ranks for _, _, right in heads)
        assert [s for _, s, _ in ranks[1]] == ["q4", "q5", "q6", "q7", "k2", "k3", "v2", "v3"]


def test_the_rank0_loader_hands_every_rank_rank_0s_rows():
    ranks = loaded_heads(Config(seq=4, query_heads=16, kv_heads=8, world_size=4), "fused_rank0")
    assert all(right for _, _, right in ranks[0])
    for heads in ranks[1:]:
        assert [s for _, s, _ in heads] == [s for _, s, _ in ranks[0]]
        assert not any(right for _, _, right in heads)


def test_read_as_plain_puts_group_1s_queries_in_the_key_slots():
    rank0 = loaded_heads(CFG, "grouped_as_plain")[0]
    assert [(slot, s) for slot, s, _ in rank0] == [
        ("q", "q0"), ("q", "q1"), ("q", "k0"), ("q", "v0"),
        ("k", "q2"), ("k", "q3"), ("v", "k1"), ("v", "v1")]
    # with one group per rank the reading is right
    assert all(r for heads in loaded_heads(Config(), "grouped_as_plain") for _, _, r in heads)


def test_the_figure_draws_one_box_per_head_and_frames_the_wrong_ones():
    pytest.importorskip("matplotlib")
    from tpattn.viz.around_loading import loaded_rows_figure

    fig = loaded_rows_figure(CFG, ("grouped", "fused_rank0"))
    good, bad = fig.axes
    assert len(good.patches) == len(bad.patches) == 2 * 8
    assert sorted(p.get_linewidth() for p in bad.patches).count(2) == 8  # rank 1's 8 heads
    assert all(p.get_linewidth() < 2 for p in good.patches)


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="layout must be one of"):
        loaded_heads(CFG, "qkv")
    with pytest.raises(ValueError, match="kv_heads must be >= world_size"):
        loaded_heads(Config(query_heads=8, kv_heads=2, world_size=4), "fused")
