"""``observe(..., batched=True)`` (``tpattn.zoo_batched``: the simulated ranks as a batch
dimension, what the live bug hunt of chapter 17 runs) against the rank loop (the default).

No bit parity is promised, so the contract is the one a reader sees: every hunt's
``describe`` lines and every guess's ``judge`` verdict are the loop's, every non-float
observable (setup, ledgers) is equal, and every float is within the rounding bound of
``tests/rounding.py``: ``2 * n * eps * scale`` with ``n`` the block's longest float sum and
``scale = max(|a|, |b|, 1)`` (the observables are losses, norms, ratios and cosines of order
1, and checksums whose terms are of order 1). Measured: at most ~2.3e-7 relative, > 30 times
inside.
"""
import pytest
import torch

from tpattn import Config, zoo
from tpattn.bug_hunt import HUNT_SHAPES, choices, describe, hunt_case, judge
from tpattn.observe import observe, observe_injection
from tests.rounding import longest_sum


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _leaves(obs, path=""):
    if isinstance(obs, dict):
        for k in sorted(obs):
            yield from _leaves(obs[k], f"{path}/{k}")
    elif isinstance(obs, list):
        for i, v in enumerate(obs):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, obs


def _assert_agree(loop: dict, batched: dict, cfg: Config) -> None:
    a, b = dict(_leaves(loop)), dict(_leaves(batched))
    assert a.keys() == b.keys()
    bound = 2 * longest_sum(cfg) * torch.finfo(torch.float32).eps
    for path, x in a.items():
        y = b[path]
        if isinstance(x, float):
            assert abs(x - y) <= bound * max(abs(x), abs(y), 1.0), (path, x, y, bound)
        else:
            assert x == y, (path, x, y)


def _cases():
    for cfg in HUNT_SHAPES:
        for mode in zoo.runnable_modes():
            try:
                zoo.check_needs(mode, cfg)
            except ValueError:
                continue
            yield pytest.param(mode, cfg, id=f"{mode}-W{cfg.world_size}")


@pytest.mark.parametrize("mode, cfg", list(_cases()))
def test_batched_ranks_show_what_the_loop_shows(mode, cfg):
    loop, batched = observe(mode, 5, cfg), observe(mode, 5, cfg, batched=True)
    _assert_agree(loop, batched, cfg)
    assert describe(batched) == describe(loop)
    for guess in choices():
        assert judge(batched, mode, guess) == judge(loop, mode, guess), guess


@pytest.mark.parametrize("hunt", [0, 2, 10, 18, 33])
def test_the_explorers_hunts_read_the_same(hunt):
    mode, seed, cfg = hunt_case(hunt)
    loop, batched = observe(mode, seed, cfg), observe(mode, seed, cfg, batched=True)
    _assert_agree(loop, batched, cfg)
    assert describe(batched) == describe(loop)


def test_a_made_up_per_rank_learning_rate_is_batched_too():
    """``rank_lr_scale`` (outside the registry): rank 1's replicas drift from rank 0's in
    both paths, by the same amounts within rounding."""
    cfg = Config(query_heads=8, kv_heads=4)
    inj = zoo.Injection(rank_lr_scale=(1.0, 1.5))
    loop = observe_injection(inj, 3, cfg)
    batched = observe_injection(inj, 3, cfg, batched=True)
    _assert_agree(loop, batched, cfg)
    norms = batched["replica_checksums"]["after_1"]["norm"]
    assert norms[0] != norms[1]
    assert describe(batched) == describe(loop)


def test_replicas_of_a_correct_run_stay_bit_identical():
    """Ranks that compute on equal numbers get equal bits in a batched kernel too."""
    cfg = HUNT_SHAPES[1]
    obs = observe("row_bias_on_every_rank", 7, cfg, batched=True)
    for when in ("after_1", "after_k"):
        for name, sums in obs["replica_checksums"][when].items():
            assert len(set(sums)) == 1, (when, name, sums)
