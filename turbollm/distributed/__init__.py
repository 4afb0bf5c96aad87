"""Tensor-parallel state of this process: its rank and the group's size (1, rank 0 unless a worker
process of a tensor-parallel engine set it with `init_tensor_parallel` before building its model).

Layers read it when they are built (`layers/linear.py`, `layers/embedding.py`): each rank keeps
its shard of every weight. The collectives run on `torch.distributed` (gloo on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0


_STATE = ParallelState()


def get_tp() -> ParallelState:
    """The tensor-parallel group of this process (size 1, rank 0 until a worker sets it)."""
    return _STATE


def set_tp(state: ParallelState) -> None:
    global _STATE
    _STATE = state


def divide(n: int, parts: int) -> int:
    if n % parts:
        raise ValueError(f"{n} is not divisible by tensor-parallel size {parts}")
    return n // parts
