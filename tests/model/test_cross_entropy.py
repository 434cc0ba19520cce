"""``VocabParallelCrossEntropy`` against ``F.cross_entropy`` on the gathered logits: the
per-token loss, the logits' gradient, gradcheck in float64, and its three ledger entries."""
import pytest
import torch
import torch.nn.functional as F

from tpattn.config import Config
from tpattn.parallel.collectives import (CE_MAX_LABEL, CE_MEAN_LABEL, CE_SUM_EXP_LABEL,
                                         CE_TARGET_LABEL,
                                         SimulatedRanks, VocabParallelCrossEntropy, group_max)

VOCAB = 12


def case(world_size: int, dtype=torch.float64, seed: int = 0):
    """Full logits ``[S, B, V]``, targets ``[S, B]`` (each rank owns some), their shards."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(5, 3, VOCAB, generator=g, dtype=torch.float64) * 3).to(dtype)
    target = torch.randperm(15, generator=g).remainder(VOCAB).view(5, 3)
    shards = torch.stack(full.chunk(world_size, -1)).clone().requires_grad_(True)
    return full.requires_grad_(True), target, shards


def ranks(world_size: int, ledger=None) -> SimulatedRanks:
    cfg = Config(world_size=world_size, query_heads=world_size, kv_heads=world_size)
    return SimulatedRanks(cfg, ledger)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_loss_and_gradient_equal_cross_entropy_on_the_gathered_logits(world_size):
    full, target, shards = case(world_size)
    comm = ranks(world_size)
    loss = VocabParallelCrossEntropy.apply(shards, target.expand(world_size, -1, -1), comm)
    expected = F.cross_entropy(full.reshape(-1, VOCAB), target.reshape(-1),
                               reduction="none").view(5, 3)
    for rank in range(world_size):  # every TP rank holds the whole per-token loss
        torch.testing.assert_close(loss[rank], expected, rtol=0, atol=1e-14)
    weights = torch.linspace(0.5, 2.0, 15, dtype=torch.float64).view(5, 3)
    (loss * weights).sum().backward()  # each rank backpropagates its own copy of the loss
    (expected * weights).sum().backward()
    torch.testing.assert_close(torch.cat(list(shards.grad), -1), full.grad, rtol=0, atol=1e-15)


def one_loss(full: torch.Tensor, target: torch.Tensor, world_size: int) -> torch.Tensor:
    """The loss ``[S, B]`` of full logits ``[S, B, V]`` cut into shards: its value rank 0's copy,
    its gradient every rank's backward of its own copy (as each real rank runs it)."""
    loss = VocabParallelCrossEntropy.apply(torch.stack(full.chunk(world_size, -1)),
                                           target.expand(world_size, -1, -1), ranks(world_size))
    return loss[0].detach() + (loss - loss.detach()).sum(0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradcheck_in_float64(world_size):
    full, target, _ = case(world_size)
    assert torch.autograd.gradcheck(lambda t: one_loss(t, target, world_size), (full,))


def test_a_target_outside_the_rank_slice_contributes_nothing_to_its_gradient():
    _, target, shards = case(2)
    target = torch.zeros_like(target)  # rank 0 owns every target
    loss = VocabParallelCrossEntropy.apply(shards, target.expand(2, -1, -1), ranks(2))
    loss.sum().backward()
    assert (shards.grad[1] > 0).all()  # rank 1: softmax only, no -1
    assert (shards.grad[0][..., 0] < 0).all()


def test_large_logits_stay_finite_through_the_shared_max():
    _, target, shards = case(2)
    loss = VocabParallelCrossEntropy.apply(shards.detach() + 1000.0, target.expand(2, -1, -1),
                                           ranks(2))
    assert torch.isfinite(loss).all()


def test_three_labelled_forward_collectives_and_none_in_backward():
    ledger = []
    _, target, shards = case(2)
    loss = VocabParallelCrossEntropy.apply(shards, target.expand(2, -1, -1), ranks(2, ledger))
    loss.sum().backward()
    assert [(e["label"], e["op"], e["phase"]) for e in ledger] == [
        (CE_MAX_LABEL, "max", "forward"), (CE_TARGET_LABEL, "sum", "forward"),
        (CE_SUM_EXP_LABEL, "sum", "forward")]


def test_group_max_is_the_elementwise_max_of_each_tp_group():
    mesh = SimulatedRanks(Config(world_size=2, data_parallel=2))  # TP groups [0, 1], [2, 3]
    t = torch.tensor([[1.0, 5.0], [3.0, 2.0], [0.0, 9.0], [4.0, 4.0]])
    assert group_max(t, mesh, "max").tolist() == [[3.0, 5.0]] * 2 + [[4.0, 9.0]] * 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_bfloat16_logits_are_upcast_loss_float32_gradient_bfloat16(world_size):
    full, target, shards = case(world_size, torch.bfloat16)
    shards = shards.detach().requires_grad_(True)
    loss = VocabParallelCrossEntropy.apply(shards, target.expand(world_size, -1, -1),
                                           ranks(world_size))
    assert loss.dtype == torch.float32
    expected = F.cross_entropy(full.detach().float().reshape(-1, VOCAB), target.reshape(-1),
                               reduction="none").view(5, 3)
    # float32 arithmetic on the same bfloat16 inputs: float32 rounding, not bfloat16's 4e-3
    torch.testing.assert_close(loss[0], expected, rtol=0, atol=1e-5)
    loss.sum().backward()
    assert shards.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_label_smoothing_equals_torch_on_the_gathered_logits(world_size):
    full, target, shards = case(world_size)
    loss = VocabParallelCrossEntropy.apply(shards, target.expand(world_size, -1, -1),
                                           ranks(world_size), 0.1)
    expected = F.cross_entropy(full.reshape(-1, VOCAB), target.reshape(-1),
                               reduction="none", label_smoothing=0.1).view(5, 3)
    for rank in range(world_size):
        torch.testing.assert_close(loss[rank], expected, rtol=0, atol=1e-14)
    loss.sum().backward()  # each rank backpropagates its own copy of the loss
    expected.sum().backward()
    torch.testing.assert_close(torch.cat(list(shards.grad), -1), full.grad, rtol=0, atol=1e-15)


def test_label_smoothing_adds_one_all_reduce_of_the_logit_sums():
    ledger = []
    _, target, shards = case(2)
    VocabParallelCrossEntropy.apply(shards, target.expand(2, -1, -1), ranks(2, ledger), 0.1)
    assert [e["label"] for e in ledger] == [CE_MAX_LABEL, CE_TARGET_LABEL, CE_SUM_EXP_LABEL,
                                            CE_MEAN_LABEL]
