"""tpattn — tensor-parallel attention, built, sharded, checked and broken.

``tpattn.observe(mode, seed)`` and ``tpattn.diagnose(observations)``: what a run shows
without a dense model, and which bug of the registry (``tpattn.zoo``) explains it (the
functions shadow their modules' names; ``from tpattn.diagnose import features`` still works).

``import tpattn`` loads torch and nothing heavier; plotting (``tpattn.viz``) and widgets
(``tpattn.widgets``) load only when imported, Hugging Face's ``transformers`` only with
``tpattn.interop``, and ``tpattn.check_module`` (``tpattn.module_check``) on first use.
"""
from .config import Config
from .layers import apply_rope, attention, repeat_kv, rms_norm
from .params import clone_trainable, init_params, shard_params
from .dense import dense_forward
from .tp import copy_to_ranks, reduce_output_partials, tp_forward
from .check import (
    EQUIVALENCE,
    MEASURES,
    MISSING_INPUT_GRAD_REDUCE,
    MISSING_OUTPUT_REDUCE,
    MODES,
    SEEDS,
    TOLERANCE,
    assert_close_within,
    inspect_fixture,
    run,
    run_matrix,
)
from .observe import observe
from .diagnose import diagnose

__all__ = [
    "Config", "rms_norm", "apply_rope", "repeat_kv", "attention",
    "init_params", "clone_trainable", "shard_params", "dense_forward",
    "copy_to_ranks", "reduce_output_partials", "tp_forward",
    "run", "run_matrix", "inspect_fixture",
    "MODES", "EQUIVALENCE", "MISSING_OUTPUT_REDUCE", "MISSING_INPUT_GRAD_REDUCE",
    "SEEDS", "MEASURES", "TOLERANCE", "assert_close_within", "observe", "diagnose",
]


def __getattr__(name: str):
    """``tpattn.check_module``: imported on first use (it pulls in torch.distributed.tensor)."""
    if name == "check_module":
        from .module_check import check_module

        return check_module
    raise AttributeError(f"module 'tpattn' has no attribute {name!r}")
