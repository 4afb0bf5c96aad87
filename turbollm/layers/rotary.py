"""Rotary position embedding (NeoX layout: the two halves of each head form the pairs).

Llama-family GGUF files store Q/K rows permuted for the interleaved layout; the loader
undoes that permutation, so one RoPE serves every architecture. For float32 the C++ kernel
rotates q and k in place in one pass (`kernels/csrc/fused_ops.cpp`); `rope_reference` is the
plain path.
"""

from __future__ import annotations

import torch
from torch import nn

from turbollm.kernels import cpu_kernels


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self._cache_len = 0
        self._grow(min(max_position, 4096))
        self.max_position = max_position

    def _grow(self, n: int) -> None:
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        t = torch.arange(n, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        self.cos, self.sin = freqs.cos(), freqs.sin()
        self._cache_len = n

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D], positions: [T] (whose max is `max_position` when given) → rotated (q, k)."""
        if positions.numel():
            top = int(positions.max()) if max_position is None else max_position
            if top >= self._cache_len:
                self._grow(max(top + 1, 2 * self._cache_len))
        kernels = cpu_kernels()
        if kernels is not None and q.dtype == torch.float32 and k.dtype == torch.float32 \
                and q.stride(-1) == 1 and k.stride(-1) == 1:
            kernels.rope_(q, k, positions, self.cos, self.sin)
            return q, k
        return rope_reference(positions, q, k, self.cos, self.sin)


def rope_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                   sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain PyTorch NeoX rotation of q and k (new tensors)."""
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    cos2 = torch.cat([cos, cos], dim=-1)
    sin2 = torch.cat([sin, sin], dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos2 + rotated * sin2).to(x.dtype)
