"""Plain float types and ggml's original 32-element block quants.

F32, F16, BF16 and F64 are stored one element per "block"; Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
hold 32 weights per block with one fp16 scale (and, for the ``_1`` variants, an fp16 offset).
In the 4- and 5-bit types, the low nibbles of the 16 packed bytes are elements 0..15 and the
high nibbles are elements 16..31.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from ._base import BlockType, f16, nibbles, split, unpack


class F32(BlockType, qtype=T.F32):
    """IEEE binary32: 4 bytes per element, returned unchanged."""

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.contiguous().view(torch.float32)


class F16(BlockType, qtype=T.F16):
    """IEEE binary16: 2 bytes per element, widened exactly to float32."""

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        return f16(blocks)


class BF16(BlockType, qtype=T.BF16):
    """bfloat16: 2 bytes per element, the top half of a float32; widened by a 16-bit shift.

    The shift is done on integers so that every bit pattern (NaN payloads included) comes out
    exactly as gguf-py produces it.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        bits = blocks.contiguous().view(torch.int16).to(torch.int32) << 16
        return bits.view(torch.float32)


class F64(BlockType, qtype=T.F64):
    """IEEE binary64: 8 bytes per element, rounded to nearest float32 (as numpy's astype).

    gguf-py has no dequantizer for F64; the reference is ``numpy.astype(np.float32)``.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.contiguous().view(torch.float64).to(torch.float32)


class Q4_0(BlockType, qtype=T.Q4_0):
    """18 bytes / 32 weights: ``d`` fp16 (2) | 32 x 4-bit ``q`` (16); ``w = d * (q - 8)``."""

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs = split(blocks, 2, 16)
        q = nibbles(qs, dim=1).reshape(n, 32).to(torch.int8) - 8
        return q.to(torch.float32).mul_(f16(d))


class Q4_1(BlockType, qtype=T.Q4_1):
    """20 bytes / 32 weights: ``d`` fp16 | ``m`` fp16 | 32 x 4-bit ``q``; ``w = (d * q) + m``."""

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, m, qs = split(blocks, 2, 2, 16)
        q = nibbles(qs, dim=1).reshape(n, 32).to(torch.float32)
        return q.mul_(f16(d)).add_(f16(m))


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit values: nibble of element j | bit j of the little-endian uint32 ``qh``, as uint8."""
    n = qs.shape[0]
    low = nibbles(qs, dim=1).reshape(n, 32)
    high = unpack(qh, 1, dim=-1).reshape(n, 32)  # byte-major: bit j of qh is element j
    return low | (high << 4)


class Q5_0(BlockType, qtype=T.Q5_0):
    """22 bytes / 32 weights: ``d`` fp16 | ``qh`` 32 high bits (4) | 32 low nibbles (16);
    ``w = d * (q - 16)``."""

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        d, qh, qs = split(blocks, 2, 4, 16)
        q = _q5_values(qh, qs).to(torch.int8) - 16
        return q.to(torch.float32).mul_(f16(d))


class Q5_1(BlockType, qtype=T.Q5_1):
    """24 bytes / 32 weights: ``d`` fp16 | ``m`` fp16 | ``qh`` (4) | low nibbles (16);
    ``w = (d * q) + m``."""

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        d, m, qh, qs = split(blocks, 2, 2, 4, 16)
        q = _q5_values(qh, qs).to(torch.float32)
        return q.mul_(f16(d)).add_(f16(m))


class Q8_0(BlockType, qtype=T.Q8_0):
    """34 bytes / 32 weights: ``d`` fp16 | 32 x int8 ``q``; ``w = q * d``."""

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        d, qs = split(blocks, 2, 32)
        q = qs.contiguous().view(torch.int8).to(torch.float32)
        return q.mul_(f16(d))
