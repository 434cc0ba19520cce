"""The decoder LM's bug zoo: every mode ``--model lm`` accepts, as an ``LMBugMode`` of
``LM_REGISTRY``, each a substitution of one stage of the correct ``LMProgram``."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tpattn.model.tp import LM_CORRECT, LMProgram
from tpattn.check.measures import MEASURES
from .zoo import FIDELITIES

__all__ = ["LMBugMode", "LM_REGISTRY", "LM_EQUIVALENCE", "skipped_collective", "lm_program",
           "lm_mode_names"]

#: The correct LM's mode name.
LM_EQUIVALENCE = "lm_equivalence"


def skipped_collective(t: torch.Tensor, comm, label: str = "") -> torch.Tensor:
    """A dropped LM collective (an f or a g): ``t`` as it is, nothing on the ledger."""
    return t


@dataclass(frozen=True)
class LMBugMode:
    """One LM mode: ``program`` the correct ``LMProgram`` with the bug's stage substituted,
    ``citation`` the public report(s), ``fidelity`` one of ``FIDELITIES``, ``fidelity_note``
    what the report showed and where this differs, ``fails`` the ``MEASURES`` it fails."""

    name: str
    description: str
    program: LMProgram
    citation: str | None = None
    fidelity: str = "no report"
    fidelity_note: str = ""
    fails: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.fidelity not in FIDELITIES:
            raise ValueError(f"LMBugMode {self.name}: fidelity must be one of {FIDELITIES} "
                             f"(got {self.fidelity!r})")

    def as_dict(self) -> dict:
        """What ``--model lm --list-modes`` prints for this mode."""
        return {"name": self.name, "description": self.description, "citation": self.citation,
                "fidelity": self.fidelity, "fidelity_note": self.fidelity_note,
                "fails": list(self.fails)}


def _bug(name: str, **stages) -> LMProgram:
    """``LM_CORRECT`` with ``stages`` replaced, named ``name``."""
    return replace(LM_CORRECT, name=name, **stages)


#: The measures a bug fails: the three of the backward and the step, or all five.
GRADS = MEASURES[2:]
ALL = MEASURES

#: name -> LMBugMode, in listing order.
LM_REGISTRY: dict[str, LMBugMode] = {m.name: m for m in [
    LMBugMode(LM_EQUIVALENCE, "correct TP for the whole LM", LM_CORRECT, fidelity="correct",
              fidelity_note="not a bug: the correct program every other LM mode is compared "
              "with"),
    LMBugMode("embed_reduce_missing",
              "the vocabulary-parallel embedding's g dropped: each rank keeps the rows of its "
              "own slice", _bug("embed_reduce_missing", embed_g=skipped_collective),
              fails=ALL, fidelity_note="the embedding's twin of the block's dropped g; no "
              "public report is cited"),
    LMBugMode("mlp_output_reduce_missing",
              "the MLP's g dropped: each rank's MLP output is its own partial",
              _bug("mlp_output_reduce_missing", mlp_g=skipped_collective), fails=ALL,
              fidelity_note="the block's missing g, in the MLP; no public report is cited"),
    LMBugMode("mlp_input_grad_reduce_missing",
              "the MLP's f dropped: its dn keeps one rank's contribution",
              _bug("mlp_input_grad_reduce_missing", mlp_f=skipped_collective), fails=GRADS,
              fidelity_note="the block's missing f, in the MLP; no public report is cited"),
    LMBugMode("head_input_grad_reduce_missing",
              "the LM head's f dropped: the final norm's dn keeps one rank's vocabulary slice",
              _bug("head_input_grad_reduce_missing", head_f=skipped_collective),
              fails=GRADS, fidelity_note="the column-parallel head's missing f; no public "
              "report is cited"),
]}


def lm_mode_names() -> list[str]:
    """Every LM mode name, in listing order."""
    return list(LM_REGISTRY)


def lm_program(mode: str) -> LMProgram:
    """The ``LMProgram`` of ``mode``; ``ValueError`` naming the LM modes for any other name."""
    if mode not in LM_REGISTRY:
        raise ValueError(f"mode must be one of the LM's modes {lm_mode_names()} (got {mode!r})")
    return LM_REGISTRY[mode].program
