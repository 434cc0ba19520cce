"""Hypothesis strategies for Configs, valid by construction (and the raw fields for invalid ones)."""
from hypothesis import strategies as st

from tpattn import Config


@st.composite
def valid_configs(draw, world_sizes=(1, 2, 4, 8), dtypes=("float32", "float64"), max_seq=6, max_hidden=24):
    """A valid Config: kv_heads a multiple of world_size, query_heads a multiple of kv_heads.

    Sizes stay small (as the seed's), where float32 rounding keeps correct TP within 1e-6 of dense.
    """
    world_size = draw(st.sampled_from(world_sizes))
    kv_heads = world_size * draw(st.integers(1, 2))
    return Config(
        seq=draw(st.integers(1, max_seq)),
        batch=draw(st.integers(1, 3)),
        hidden=draw(st.integers(1, max_hidden)),
        query_heads=kv_heads * draw(st.integers(1, 3)),
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([2, 4, 6, 8])),
        world_size=world_size,
        eps=draw(st.sampled_from([1e-6, 1e-5, 1e-3])),
        dtype=draw(st.sampled_from(dtypes)),
    )
