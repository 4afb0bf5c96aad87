"""Parallel state of this process: its tensor-parallel rank and group size, and its pipeline stage
(1 and rank 0, every layer, unless a worker process of a parallel engine set it with
`init_parallel` before building its model).

Layers read it when they are built (`layers/linear.py`, `layers/embedding.py`): each rank keeps
its shard of every weight; the models build only their stage's layers (`holds_layer`) and the
loader reads only their tensors (`holds_weight`). The collectives and sends run on
`torch.distributed` (gloo on CPU).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    # the MLP width is split across ranks in multiples of this (the largest GGML block of the down
    # projections, so no rank's share of them cuts a block; the loader sets it before building)
    mlp_align: int = 1
    # pipeline parallelism: this process's stage of pp_size, which runs layers layer_start .. layer_end - 1
    # (layer_end None: to the last); the first stage embeds (its rows looked up by the last one when the table is
    # tied to the LM head), the last one norms, projects and samples
    pp_size: int = 1
    pp_rank: int = 0
    layer_start: int = 0
    layer_end: int | None = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def holds_layer(self, i: int) -> bool:
        return self.layer_start <= i and (self.layer_end is None or i < self.layer_end)

    def embedding_stage(self, tied: bool) -> int:
        """The stage that looks the tokens up: the first, or the last when the table is tied to the LM head
        (the last stage holds it anyway, so it lives once, and the looked-up rows are sent to the first)."""
        return self.pp_size - 1 if tied else 0

    def holds_embedding(self, tied: bool) -> bool:
        """Whether this stage builds and loads the input embedding."""
        return self.pp_rank == self.embedding_stage(tied)

    def holds_weight(self, hf_name: str, tied: bool) -> bool:
        """Whether this stage loads checkpoint tensor `hf_name` (Hugging Face naming)."""
        if self.pp_size == 1:
            return True
        if hf_name.startswith("model.layers."):  # (past the model's layers: the last stage's, to refuse)
            i = int(hf_name.split(".")[2])
            return i >= self.layer_start if self.is_last_stage else self.holds_layer(i)
        if hf_name.startswith("model.embed_tokens."):
            return self.holds_embedding(tied)
        if hf_name.startswith(("lm_head.", "model.norm.")):
            return self.is_last_stage
        return True

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


@contextlib.contextmanager
def single_rank():
    """Build a model whole in a rank of a parallel engine (a draft model, unsharded, on the rank that drafts):
    layers read the parallel state when they are built, so inside this block they keep every weight."""
    saved = _STATE
    set_tp(ParallelState())
    try:
        yield
    finally:
        set_tp(saved)


def divide(n: int, parts: int) -> int:
    if n % parts:
        raise ValueError(f"{n} is not divisible by tensor-parallel size {parts}")
    return n // parts
