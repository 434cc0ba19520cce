"""The reduce op in the real ranks' ledger: an averaged reduction is issued as SUM then a
division (gloo has no AVG) and recorded as ``"avg"``, what the program asked for, exactly as
the simulated ranks record it; the numbers are the simulated ranks' too."""
import pytest
import torch

from tpattn import Config
from tpattn.check.core import LR
from tpattn.parallel.simulated import simulated_step
from tpattn.real.backend import RealRanks, build_groups
from tpattn.real.launch import run_on_ranks
from tpattn.real.ranks import job_setup, planned_ledger, rank_step

pytestmark = pytest.mark.timeout(120)

#: A program that averages f's all-reduce, and one that averages SP's norm-gradient reduce.
AVERAGED = (("input_grad_reduce_averaged", Config()),
            ("norm_grad_averaged", Config(seq=8, sequence_parallel=True)))


def averaged_steps(rank, plan, device, on_progress):
    """Each program of ``AVERAGED`` on this real rank: its ledger and the gathered gradients."""
    on_progress(0)
    out = []
    for mode, cfg in AVERAGED:
        comm = RealRanks(cfg, build_groups(cfg), rank, planned_ledger(mode, cfg), mode)
        step, _, _ = rank_step(11, mode, cfg, comm)
        comm.check_plan()
        out.append((comm.ledger, step["input_grads"], step["grads"]["norm"]))
    return out


def test_the_real_ledger_records_the_op_the_program_asked_for():
    results, _ = run_on_ranks(averaged_steps, 2, None, timeout=30.0, backend="gloo")
    for (mode, cfg), (ledger, input_grads, norm_grad) in zip(AVERAGED, results[0]):
        inj, _, shards, batches = job_setup(11, mode, cfg)
        simulated = simulated_step(shards, batches, cfg, inj, LR)
        assert ledger == simulated["ledger"]
        assert "avg" in [e["op"] for e in ledger]
        assert torch.allclose(input_grads, simulated["input_grads"], rtol=0, atol=1e-6)
        assert torch.allclose(norm_grad, simulated["grads"]["norm"], rtol=0, atol=1e-6)
