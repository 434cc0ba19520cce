"""The reduce op in the real ranks' ledger: an averaged reduction is issued as SUM then a
division (gloo has no AVG) and recorded as ``"avg"``, what the program asked for; a summed
one is recorded as ``"sum"`` (``CollectiveLedger.entries``, as the simulated ranks' ledger)."""
import pytest
import torch

from tpattn import Config
from tpattn.real.launch import run_on_ranks
from tpattn.real.ranks import F_ALL_REDUCE, CollectiveLedger, DistributedRanks
from tpattn.real.sp_ranks import AR_NORM, SequenceLedger, finalize_norm_grad

pytestmark = pytest.mark.timeout(120)


def reduce_with(rank, op, device, on_progress):
    """f (through ``DistributedRanks``, as ``engine.rank_block`` calls it) and the SP norm
    gradient's reduce, each with ``op``; rank r contributes r + 1. Returns the ledgers'
    entries and what each reduction gave."""
    on_progress(0)
    ledger = CollectiveLedger()
    ledger.start_job("f", [F_ALL_REDUCE])
    n = torch.zeros(1, 2, 3, requires_grad=True)
    out = DistributedRanks(Config(), ledger, rank).copy_to_ranks(n, op=op)
    (out * (rank + 1)).sum().backward()
    sp = SequenceLedger()
    sp.start_job("norm", [AR_NORM])
    norm = finalize_norm_grad(torch.full((3,), float(rank + 1)), sp,
                              "mean" if op == "avg" else "sum")
    return ledger.entries, sp.entries, n.grad.unique().tolist(), norm.unique().tolist()


@pytest.mark.parametrize("op, value", [("sum", 3.0), ("avg", 1.5)])
def test_the_real_ledger_records_the_op_the_program_asked_for(op, value):
    results, _ = run_on_ranks(reduce_with, 2, op, timeout=30.0, backend="gloo")
    for f_entries, norm_entries, dn, norm in results:
        assert dn == [value] and norm == [value]  # 1 + 2, or its mean
        assert [(e["phase"], e["group"], e["op"]) for e in f_entries] == [("backward", "tp", op)]
        assert [(e["phase"], e["op"]) for e in norm_entries] == [("after backward", op)]


def test_a_bad_op_is_a_value_error():
    with pytest.raises(ValueError, match="op must be 'sum' or 'avg'"):
        CollectiveLedger().all_reduce(torch.ones(1), "backward", F_ALL_REDUCE, op="max")
