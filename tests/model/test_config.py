"""``LMConfig`` rejects each bad field with a ``ValueError`` naming the field and the rule."""
import pytest

from tpattn.config import Config
from tpattn.model.config import LMConfig


@pytest.mark.parametrize("kwargs, words", [
    ({"vocab": 0}, "vocab must be an integer >= 1"),
    ({"vocab": "32"}, "vocab must be an integer >= 1"),
    ({"vocab": True}, "vocab must be an integer >= 1"),
    ({"vocab": 33}, "vocab must be a multiple of block.world_size"),
    ({"layers": 0}, "layers must be an integer >= 1"),
    ({"layers": 1.5}, "layers must be an integer >= 1"),
    ({"ffn": -4}, "ffn must be an integer >= 1"),
    ({"ffn": 30, "block": Config(world_size=4)}, "ffn must be a multiple of block.world_size"),
    ({"tied": 1}, "tied must be True or False"),
    ({"mlp_bias": "yes"}, "mlp_bias must be True or False"),
    ({"label_smoothing": 1.0}, "label_smoothing must be a number with 0 <= label_smoothing < 1"),
    ({"label_smoothing": -0.1}, "label_smoothing must be a number with 0 <= label_smoothing"),
    ({"label_smoothing": float("nan")}, "label_smoothing must be a number"),
    ({"label_smoothing": True}, "label_smoothing must be a number"),
    ({"block": {"world_size": 2}}, "block must be a tpattn.config.Config"),
    ({"block": Config(sequence_parallel=True, seq=4)}, "block.sequence_parallel must be False"),
    ({"block": Config(data_parallel=2)}, "block.data_parallel must be 1"),
    ({"block": Config(dropout=0.1)}, "block.dropout must be 0.0"),
    ({"block": Config(qk_norm=True)}, "block.qk_norm must be False"),
    ({"block": Config(seq=1)}, "block.seq must be >= 2"),
])
def test_a_broken_rule_is_a_value_error_naming_it(kwargs, words):
    with pytest.raises(ValueError, match="invalid LMConfig: ") as raised:
        LMConfig(**kwargs)
    assert words in str(raised.value)


def test_the_message_gives_the_values_that_break_a_divisibility_rule():
    with pytest.raises(ValueError, match=r"got vocab=30, world_size=4"):
        LMConfig(block=Config(world_size=4), vocab=30, ffn=32)


def test_every_broken_rule_is_reported_at_once():
    with pytest.raises(ValueError, match="vocab .*; layers .*; tied"):
        LMConfig(vocab=0, layers=0, tied=None)


def test_the_defaults_are_valid_and_frozen():
    lm = LMConfig()
    assert (lm.vocab, lm.layers, lm.ffn, lm.tied, lm.label_smoothing, lm.block) == (
        32, 2, 48, False, 0.0, Config())
    with pytest.raises(AttributeError):
        lm.vocab = 64
