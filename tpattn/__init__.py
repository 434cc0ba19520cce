"""tpattn — tensor-parallel attention, built, sharded, checked and broken.

``tpattn.observe`` and ``tpattn.diagnose`` shadow their modules' names; ``import tpattn``
loads torch and nothing heavier (``tpattn.check_module`` is imported on first use)."""
from tpattn.config import Config
from tpattn.block.layers import apply_rope, attention, repeat_kv, rms_norm
from tpattn.block.params import clone_trainable, init_params, shard_params
from tpattn.block.dense import dense_forward
from tpattn.parallel.tp import copy_to_ranks, reduce_output_partials, tp_forward
from tpattn.check.core import (EQUIVALENCE, MEASURES, MISSING_INPUT_GRAD_REDUCE,
                               MISSING_OUTPUT_REDUCE, MODES, SEEDS, TOLERANCE,
                               assert_close_within, inspect_fixture)
from tpattn.bugs.modes import run, run_matrix
from tpattn.diagnosis.observe import observe
from tpattn.diagnosis.diagnose import diagnose

__all__ = ["Config", "rms_norm", "apply_rope", "repeat_kv", "attention", "init_params",
           "clone_trainable", "shard_params", "dense_forward", "copy_to_ranks",
           "reduce_output_partials", "tp_forward", "run", "run_matrix", "inspect_fixture",
           "MODES", "EQUIVALENCE", "MISSING_OUTPUT_REDUCE", "MISSING_INPUT_GRAD_REDUCE", "SEEDS",
           "MEASURES", "TOLERANCE", "assert_close_within", "observe", "diagnose"]


def __getattr__(name: str):
    """``tpattn.check_module``: imported on first use (it pulls in torch.distributed.tensor)."""
    if name == "check_module":
        from tpattn.real.module_check import check_module

        return check_module
    raise AttributeError(f"module 'tpattn' has no attribute {name!r}")
