"""Paged KV cache: per-layer block storage and the block pool that hands blocks out.

Storage per layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V.
The pool keeps a free list and a reference count per block; a sequence's block table
lists its blocks in order, so token t of the sequence lives in slot
`block_table[t // block_size] * block_size + t % block_size`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from turbollm.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def from_budget(cls, cfg: ModelConfig, memory_bytes: int, block_size: int,
                    dtype: torch.dtype = torch.float32) -> "KVCacheSpec":
        probe = cls(1, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
        num_blocks = max(1, memory_bytes // (probe.bytes_per_token * block_size))
        return cls(int(num_blocks), block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)


def allocate_kv_storage(spec: KVCacheSpec) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed K and V storage for every layer (pages are committed by the OS on first write)."""
    shape = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [(torch.zeros(shape, dtype=spec.dtype), torch.zeros(shape, dtype=spec.dtype)) for _ in range(spec.num_layers)]


class BlockPool:
    """Free list + reference counts over `num_blocks` fixed-size blocks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("no free KV-cache block")  # the scheduler checks first
        block = self.free.popleft()
        self.ref_counts[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} released twice"
            if self.ref_counts[b] == 0:
                self.free.append(b)
