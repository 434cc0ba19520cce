"""Config validation: every invalid Config is a ValueError naming the field and the rule."""
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpattn import Config

INT_FIELDS = ("seq", "batch", "hidden", "query_heads", "kv_heads", "head_dim", "world_size")


def broken_rules(f):
    """The fields whose rule the raw values break, by an independent reading of the rules."""
    bad = {n for n in INT_FIELDS if isinstance(f[n], bool) or not isinstance(f[n], int) or f[n] < 1}
    if bad:
        return bad  # Config reports bad integers first: the divisibility rules need valid ones
    eps = f["eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        bad.add("eps")
    if f["head_dim"] % 2:
        bad.add("head_dim")
    if f["query_heads"] % f["kv_heads"]:
        bad.add("query_heads")
    if f["kv_heads"] >= f["world_size"] and f["kv_heads"] % f["world_size"]:
        bad.add("kv_heads")  # each rank holds whole KV heads
    if f["kv_heads"] < f["world_size"] and f["world_size"] % f["kv_heads"]:
        bad.add("kv_heads")  # each KV head replicated on world_size/kv_heads ranks
    if f["kv_heads"] < f["world_size"] and f["query_heads"] % f["world_size"]:
        bad.add("query_heads")
    if f["dtype"] not in ("float32", "float64", "bfloat16", torch.float32, torch.float64,
                          torch.bfloat16):
        bad.add("dtype")
    return bad


field_values = st.fixed_dictionaries({
    **{n: st.one_of(st.integers(-2, 9), st.sampled_from([0.5, True, "4", None])) for n in INT_FIELDS},
    "eps": st.one_of(st.sampled_from([1e-6, 0.0, -1e-6, math.inf, math.nan, "1e-6", None, True]),
                     st.floats(1e-12, 1.0)),
    "dtype": st.sampled_from(["float32", "float64", torch.float32, torch.float64, "float16",
                              torch.bfloat16, "fp32", None]),
})


@given(f=field_values)
@settings(max_examples=300, deadline=None)
def test_config_accepts_exactly_the_valid_fields_and_names_every_broken_one(f):
    bad = broken_rules(f)
    if not bad:
        cfg = Config(**f)
        assert cfg.dtype in ("float32", "float64", "bfloat16")
        return
    with pytest.raises(ValueError) as e:
        Config(**f)
    message = str(e.value)
    assert message.startswith("invalid Config: ") and "\n" not in message
    for name in bad:
        assert re.search(rf"\b{name}\b", message), (name, message)


@pytest.mark.parametrize("kwargs, rule", [
    (dict(seq=0), r"seq must be an integer >= 1 \(got 0\)"),
    (dict(head_dim=3), r"head_dim must be even"),
    (dict(query_heads=6, kv_heads=4, world_size=1), r"query_heads must be a multiple of kv_heads"),
    (dict(kv_heads=4, query_heads=8, world_size=3), r"kv_heads must be a multiple of world_size when kv_heads >= world_size"),
    (dict(kv_heads=2, query_heads=6, world_size=3), r"world_size must be a multiple of kv_heads when kv_heads < world_size"),
    (dict(kv_heads=2, query_heads=6, world_size=3), r"its K/V weights replicated on them"),
    (dict(kv_heads=2, query_heads=6, world_size=3, kv_strategy="gather_activations"),
     r"its K/V activations gathered to them"),
    (dict(kv_heads=1, query_heads=2, world_size=4), r"query_heads must be a multiple of world_size when kv_heads < world_size"),
    (dict(kv_strategy="gather"), r"kv_strategy must be one of replicate_weights, gather_activations"),
    (dict(kv_heads=1, query_heads=8, world_size=8, kv_strategy="gather_activations"),
     r"kv_strategy='gather_activations' needs kv_heads\*head_dim to be a multiple of world_size"),
    (dict(eps=0), r"eps must be a finite number > 0"),
    (dict(dtype="float16"), r"dtype must be one of \['bfloat16', 'float32', 'float64'\]"),
])
def test_each_rule_has_a_message_that_says_it(kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        Config(**kwargs)


def test_replication_is_mentioned_only_when_kv_heads_is_below_world_size():
    # kv_heads=3 on 2 ranks is not a replication case: 3 KV heads are more than the ranks
    with pytest.raises(ValueError, match=r"kv_heads must be a multiple of world_size") as e:
        Config(query_heads=6, kv_heads=3, world_size=2)
    assert "replicat" not in str(e.value)


def test_defaults_are_the_seed_fixture():
    cfg = Config()
    assert (cfg.seq, cfg.batch, cfg.hidden, cfg.query_heads, cfg.kv_heads, cfg.head_dim,
            cfg.world_size, cfg.eps, cfg.dtype) == (5, 2, 16, 4, 2, 4, 2, 1e-6, "float32")
    assert (cfg.group_size, cfg.local_query_heads, cfg.local_kv_heads) == (2, 2, 1)
    assert (cfg.kv_strategy, cfg.kv_replicas) == ("replicate_weights", 1)


def test_fewer_kv_heads_than_ranks_is_accepted_as_replicas():
    cfg = Config(query_heads=8, kv_heads=2, world_size=4)
    assert (cfg.local_query_heads, cfg.local_kv_heads, cfg.kv_replicas) == (2, 1, 2)


def test_config_is_frozen_and_stores_a_torch_dtype_by_name():
    cfg = Config(dtype=torch.float64)
    assert cfg.dtype == "float64" and cfg.torch_dtype is torch.float64
    with pytest.raises(AttributeError):
        cfg.seq = 3
