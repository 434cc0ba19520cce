"""run_on_ranks names the rank whose process died, not the peer that saw the broken link.

A rank that leaves with ``os._exit(9)`` in the middle of a run breaks its peers' connections
(gloo: "Connection reset by peer" or similar); the ``RankFailure`` must blame the rank that
died, with its exit code, first, and list what the others saw after it.
"""
import pytest
import torch
import torch.distributed as dist

from tpattn.real.launch import RankFailure, run_on_ranks


def dies_on_rank_1(rank, plan, device, on_progress):
    """Rank 1 exits with code 9 before the all-reduce rank 0 waits in."""
    on_progress(0)
    if rank == 1:
        import os
        os._exit(9)
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def sums_ones(rank, plan, device, on_progress):
    """Every rank contributes 1: the all-reduce gives world_size."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def test_ranks_that_finish_return_their_results():
    results, timings = run_on_ranks(sums_ones, 2, None, timeout=10.0, backend="gloo")
    assert results == [2.0, 2.0] and timings["total_s"] >= timings["startup_s"] > 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_dies_is_named_first_with_its_exit_code(world_size):
    with pytest.raises(RankFailure) as e:
        run_on_ranks(dies_on_rank_1, world_size, None, timeout=5.0, backend="gloo")
    message = str(e.value)
    assert e.value.rank == 1 and "\n" not in message, message
    assert message.startswith(
        "real-rank run failed: rank 1 exited (exit code 9) before finishing its work"), message
    # the others' errors follow, after the cause
    assert "rank 0" not in message or message.index("rank 0") > message.index("rank 1 exited")
