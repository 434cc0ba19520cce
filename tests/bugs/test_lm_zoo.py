"""Every LM mode fails exactly the measures its registry entry names, at TP 2 and 4."""
import pytest

from tpattn.bugs.lm_zoo import LM_REGISTRY, lm_program
from tpattn.check.lm import judge_lm
from tpattn.check.measures import MEASURES
from tpattn.config import Config
from tpattn.model.config import LMConfig
from tpattn.model.job import dense_lm_job, simulated_lm_job
from tpattn.model.tp import gather_lm_step


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_lm_mode_fails_its_measures_and_no_other(world_size):
    lm = LMConfig(block=Config(world_size=world_size, dtype="float64"), vocab=8 * world_size)
    dense = dense_lm_job(lm, 3, 0.1)
    for name, mode in LM_REGISTRY.items():
        tp = gather_lm_step(simulated_lm_job(lm, 3, 0.1, mode.program), lm)
        result = judge_lm(3, name, lm, dense, tp, 0.1)
        failed = tuple(m for m in MEASURES if result["verdict"] != "pass"
                       and result[m] > result["bounds"][m])
        assert failed == mode.fails, name


def test_an_unknown_lm_mode_names_the_modes():
    with pytest.raises(ValueError, match="mode must be one of the LM's modes"):
        lm_program("no_such_mode")
