"""The reduce op in the real ranks' ledger: an averaged reduction is issued as SUM then a
division (gloo has no AVG) and recorded as ``"avg"``, what the program asked for; a summed
one is recorded as ``"sum"`` (``RealRanks``' ledger is the simulated ranks' own)."""
import pytest
import torch

from tpattn import Config
from tpattn.real.backend import RealRanks, build_groups
from tpattn.real.launch import run_on_ranks

pytestmark = pytest.mark.timeout(120)


def reduce_with(rank, op, device, on_progress):
    """f (``copy_to_ranks``, as ``engine.rank_block`` calls it) and the SP norm gradient's
    reduce, each with ``op``; rank r contributes r + 1. Returns the ledger's entries and what
    each reduction gave."""
    on_progress(0)
    cfg = Config()
    comm = RealRanks(cfg, build_groups(cfg), rank)
    n = torch.zeros(1, 2, 3, requires_grad=True)
    out = comm.copy_to_ranks(n, op=op)
    (out * (rank + 1)).sum().backward()
    norm = comm.reduce_norm_grad(torch.full((1, 3), float(rank + 1)),
                                 "mean" if op == "avg" else "sum")
    return comm.ledger, n.grad.unique().tolist(), norm.unique().tolist()


@pytest.mark.parametrize("op, value", [("sum", 3.0), ("avg", 1.5)])
def test_the_real_ledger_records_the_op_the_program_asked_for(op, value):
    results, _ = run_on_ranks(reduce_with, 2, op, timeout=30.0, backend="gloo")
    for entries, dn, norm in results:
        assert dn == [value] and norm == [value]  # 1 + 2, or its mean
        assert [(e["phase"], e["group"], e["op"]) for e in entries] == [
            ("backward", "tp", op), ("after backward", "tp", op)]


def test_a_bad_op_is_a_value_error():
    with pytest.raises(ValueError, match="op must be 'sum' or 'avg'"):
        RealRanks(Config(), {}, 0).copy_to_ranks(torch.ones(1, 1), op="max")
