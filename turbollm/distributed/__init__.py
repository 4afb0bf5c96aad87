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
    # the MLP width is split across ranks in multiples of this (the largest GGML block of the down
    # projections, so no rank's share of them cuts a block; the loader sets it before building)
    mlp_align: int = 1

    def shard(self, total: int, align: int = 1) -> tuple[int, int]:
        """This rank's (start, size) of `total` split in multiples of `align`, as evenly as that allows
        (the first ranks take one unit more)."""
        if total % align:
            raise ValueError(f"{total} is not a multiple of {align}")
        base, extra = divmod(total // align, self.tp_size)
        r = self.tp_rank
        return (r * base + min(r, extra)) * align, (base + (r < extra)) * align


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
