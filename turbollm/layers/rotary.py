"""Rotary position embedding (NeoX layout: the two halves of each head form the pairs).

Llama-family GGUF files store Q/K rows permuted for the interleaved layout; the loader
undoes that permutation, so one RoPE serves every architecture. For float32 the C++ kernel
rotates q and k in place in one pass (`kernels/csrc/fused_ops.cpp`); `rope_reference` is the
plain path. A checkpoint's RoPE scaling (`layers/rope_scaling.py`) changes only the
inverse frequencies and a factor on the cos/sin tables, so both paths apply it unchanged.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from turbollm.kernels import cpu_kernels
from turbollm.layers.rope_scaling import rope_frequencies


class RotaryEmbedding(nn.Module):
    """cos/sin tables [positions, head_dim / 2] (grown on demand) and the rotation of q and k.

    `scaling` is a normalized RoPE scaling dict (`normalize_rope_scaling`), `freq_factors` a
    GGUF file's per-frequency divisors; either may be None.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None = None,
                 freq_factors: Sequence[float] | None = None):
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self.inv_freq, self.attention_factor = rope_frequencies(head_dim, base, scaling, freq_factors)
        self._cache_len = 0
        self._grow(min(max_position, 4096))
        self.max_position = max_position

    def _grow(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.int64).float()
        freqs = torch.outer(t, self.inv_freq)
        self.cos, self.sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            self.cos, self.sin = self.cos * self.attention_factor, self.sin * self.attention_factor
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

    def rotate_q(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] rotated to `positions` (within the tables `forward` grew), in place when the kernel
        takes it (the same arithmetic as `forward`: a position's rotation is bit-identical either way)."""
        kernels = cpu_kernels()
        if kernels is not None and q.dtype == torch.float32 and q.is_contiguous():
            kernels.rope_(q, q[:, :0], positions, self.cos, self.sin)
            return q
        return _rotate(q, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


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
