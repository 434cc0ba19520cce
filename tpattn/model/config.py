"""``LMConfig``: the decoder LM's shape around one attention ``Config`` (frozen, validated)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tpattn.config import Config

__all__ = ["LMConfig"]

#: The block options the LM does not run yet (plain TP only), with the value each must keep.
PLAIN_BLOCK = {"sequence_parallel": False, "data_parallel": 1, "dropout": 0.0, "qk_norm": False}


@dataclass(frozen=True)
class LMConfig:
    """``layers`` blocks of ``block``'s attention plus a SwiGLU MLP of width ``ffn``, a
    vocabulary of ``vocab`` tokens, the LM head ``tied`` to the embedding or its own weight,
    the loss smoothed by ``label_smoothing`` (``F.cross_entropy``'s: target ``1 - a``, plus
    ``a / vocab`` on every token), the MLP's down projection with a bias ``[hidden]`` iff
    ``mlp_bias``; a broken rule raises ``ValueError`` naming it."""

    block: Config = field(default_factory=Config)
    vocab: int = 32
    layers: int = 2
    ffn: int = 48
    tied: bool = False
    label_smoothing: float = 0.0
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.block, Config):
            raise ValueError(f"invalid LMConfig: block must be a tpattn.config.Config "
                             f"(got {self.block!r})")
        problems = []
        for name in ("vocab", "layers", "ffn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be an integer >= 1 (got {value!r})")
            elif name != "layers" and value % self.block.world_size:
                problems.append(
                    f"{name} must be a multiple of block.world_size, so each rank holds "
                    f"{name} / world_size rows (got {name}={value}, "
                    f"world_size={self.block.world_size})")
        for name in ("tied", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be True or False (got {getattr(self, name)!r})")
        problems += _smoothing_problems(self.label_smoothing)
        problems += _block_problems(self.block)
        if problems:
            raise ValueError("invalid LMConfig: " + "; ".join(problems))


def _block_problems(block: Config) -> list[str]:
    """The rules ``block`` breaks as the LM's block, one message each."""
    problems = [f"block.{name} must be {value!r}: the LM runs plain TP only "
                f"(got {getattr(block, name)!r})"
                for name, value in PLAIN_BLOCK.items() if getattr(block, name) != value]
    if block.seq < 2:
        problems.append(f"block.seq must be >= 2, so a next token exists to predict "
                        f"(got {block.seq})")
    return problems


def _smoothing_problems(value) -> list[str]:
    """``label_smoothing``'s broken rule, if any: a finite number with ``0 <= a < 1``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0 <= value < 1:
        return [f"label_smoothing must be a number with 0 <= label_smoothing < 1 "
                f"(got {value!r})"]
    return []
