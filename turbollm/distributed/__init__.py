"""Tensor-parallel state. Single process today (tp size 1); layers already ask for their shard."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0


_STATE = ParallelState()


def get_tp() -> ParallelState:
    """The tensor-parallel group of this process (size 1, rank 0 until the executor sets it)."""
    return _STATE


def divide(n: int, parts: int) -> int:
    if n % parts:
        raise ValueError(f"{n} is not divisible by tensor-parallel size {parts}")
    return n // parts
