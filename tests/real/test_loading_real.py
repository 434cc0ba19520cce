"""Loading a fused QKV checkpoint on real gloo ranks: every rank process loads its own shard
from the full checkpoint through ``block.fused_qkv.load_qkv_weight`` (``zoo.load_rank_shard``:
with its ``tp_rank``, or without it for ``qkv_loaded_from_rank0``). The five measures and the
observables equal the simulated ranks' within 1e-6 relative, and so do the diagnoses.

One process group per shape runs every job (process start dominates the cost).
"""
import pytest

import tpattn
from tpattn import MEASURES, Config
from tpattn.diagnosis.diagnose import diagnose
from tpattn.diagnosis.observe import observe
from tpattn.diagnosis.observe_real import diagnose_rank
from tpattn.real.launch import run_on_ranks
from tpattn.real.ranks import RunPlan

from tests.real.test_observe_real import REL, assert_same_observables

pytestmark = pytest.mark.timeout(300)

MODES = ("qkv_loaded_from_rank0", "grouped_qkv_read_as_plain")
SHAPES = {"W2 kv4": Config(query_heads=8, kv_heads=4),
          "W4 hq16 kv8": Config(seq=4, query_heads=16, kv_heads=8, world_size=4)}


@pytest.fixture(scope="module", params=list(SHAPES))
def real_run(request):
    cfg = SHAPES[request.param]
    plan = RunPlan(cfg=cfg, jobs=tuple((m, 5) for m in MODES), timeout=60)
    results, _ = run_on_ranks(diagnose_rank, cfg.world_size, plan, timeout=240, backend="gloo")
    return request.param, cfg, plan, results[0]


def test_real_five_measures_equal_the_simulated_ranks(real_run):
    name, cfg, plan, rank0 = real_run
    assert [r["mode"] for r in rank0["results"]] == list(MODES)
    for real in rank0["results"]:
        simulated = tpattn.run(real["seed"], real["mode"], cfg, simulate="ranks")
        assert real["passed"] is simulated["passed"] is False
        for m in MEASURES:
            # relative to the measure, floored at 1 as assert_same_observables does: a
            # measure is a difference of two numbers of size ~1 (e.g. two losses), whose
            # rounding the all-reduce's order moves by a few ulps of 1
            assert abs(real[m] - simulated[m]) <= REL * max(abs(simulated[m]), 1.0), \
                (name, real["mode"], m, real[m], simulated[m])


def test_real_observables_and_diagnoses_equal_the_simulated_ones(real_run):
    name, cfg, plan, rank0 = real_run
    for (mode, seed), obs, found in zip(plan.jobs, rank0["observations"], rank0["diagnoses"]):
        simulated = observe(mode, seed, cfg)
        assert_same_observables(obs, simulated, f"{name} {mode}")
        assert found == diagnose(simulated), (name, mode)
