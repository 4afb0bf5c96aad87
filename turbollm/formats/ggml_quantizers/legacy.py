"""Encoders of the float types and of the 32-weight "legacy" blocks Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Each follows llama.cpp's ``quantize_row_*_ref`` (``ggml-quants.c``); gguf-py reimplements the
same routines in numpy (``gguf.quants``), and our bytes equal gguf-py's (tested). The scale is
fixed by the block's extreme values (no search): symmetric types take the value of largest
magnitude, ``d = max / -2**(bits-1)``; asymmetric ones ``d = (max - min) / (2**bits - 1)`` with
``min`` as offset. Quants are truncations of ``x/d + offset + 0.5`` (Q8_0: ``roundf``).

One known difference from the C code, shared with gguf-py: in a block whose extreme value is
a zero, the sign of that zero (and so of the fp16 ``d`` / ``m`` field) is the one the
vectorized reduction finds, where the C loop keeps ``+0.0`` (Q4_0, Q5_0) or the first element
(Q4_1, Q5_1). The decoded weights are the same.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from ._base import BlockQuantizer, first_absmax, fp16_bytes, pack_bits, rdiv


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """``d ? 1/d : 0`` in float32."""
    return torch.where(d == 0, torch.zeros_like(d), rdiv(1.0, d))


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf`` (half away from zero), exact for every float32 (gguf-py's ``np_roundf``)."""
    a = v.abs()
    fl = a.floor()
    return torch.sign(v) * (fl + torch.floor(2 * (a - fl)))


def _min_max(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block min and max, taken by numpy as gguf-py does.

    Reductions disagree only on the sign of a zero extreme (numpy, torch and the C loop,
    which keeps the first of equal values, each pick their own); numpy's choice keeps the
    ``m`` field of Q4_1 / Q5_1 byte-identical to gguf-py.
    """
    a = blocks.numpy()
    return torch.from_numpy(a.min(axis=1)), torch.from_numpy(a.max(axis=1))


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """32 quants ``(n, 32)`` -> 16 bytes: low nibble element ``j``, high nibble ``j + 16``."""
    return ((q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)).to(torch.uint8)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of 32 quants ``(n, 32)`` as a little-endian uint32 ``qh`` -> ``(n, 4)`` bytes."""
    return pack_bits((q >> 4).reshape(-1, 4, 8).transpose(1, 2), 1)


class F32(BlockQuantizer, qtype=T.F32):
    """Plain float32 (the bytes of the values)."""

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.to(torch.float32).contiguous().view(torch.uint8)


class F16(BlockQuantizer, qtype=T.F16):
    """IEEE half, rounded to nearest even."""

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.to(torch.float16).contiguous().view(torch.uint8)


class BF16(BlockQuantizer, qtype=T.BF16):
    """bfloat16 as ``ggml_compute_fp32_to_bf16``: NaNs made quiet, then round to nearest even."""

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        nan = (n & 0x7FFFFFFF) > 0x7F800000
        n = torch.where(nan, (n & 0xFFFF0000) | (64 << 16), n)
        n = (n + (0x7FFF + ((n >> 16) & 1))) >> 16
        return (n & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.uint8).reshape(blocks.shape[0], -1)


class Q8_0(BlockQuantizer, qtype=T.Q8_0):
    """34 bytes: ``d`` fp16 | 32 int8. ``d = amax / 127``, ``q = roundf(x / d)``."""

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        d = blocks.abs().amax(dim=1) / 127
        q = _roundf(blocks * _inverse(d)[:, None]).to(torch.int8).view(torch.uint8)
        return torch.cat((fp16_bytes(d), q), dim=1)


def _offset_quants(blocks: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 / Q5_0's scheme: ``d = max / -half`` (max: the value of largest magnitude, first on ties),
    ``q = trunc(x/d + half + 0.5)`` clamped to ``[0, 2 half - 1]``; (d, q int32)."""
    _, mx = first_absmax(blocks, 1)
    d = mx / -half
    return d, torch.trunc(blocks * _inverse(d)[:, None] + (half + 0.5)).clamp_(0, 2 * half - 1).to(torch.int32)


class Q4_0(BlockQuantizer, qtype=T.Q4_0):
    """18 bytes: ``d`` fp16 | 16 nibble bytes. ``d = max / -8``, ``q = min(15, trunc(x/d + 8.5))``."""

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        d, q = _offset_quants(blocks, 8)
        return torch.cat((fp16_bytes(d), _nibbles(q)), dim=1)


class Q4_1(BlockQuantizer, qtype=T.Q4_1):
    """20 bytes: ``d`` | ``m`` fp16 | 16 nibble bytes. ``d = (max-min)/15``, ``m = min``."""

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        mn, mx = _min_max(blocks)
        d = (mx - mn) / 15
        q = torch.trunc((blocks - mn[:, None]) * _inverse(d)[:, None] + 0.5).clamp_(0, 15).to(torch.int32)
        return torch.cat((fp16_bytes(d), fp16_bytes(mn), _nibbles(q)), dim=1)


class Q5_0(BlockQuantizer, qtype=T.Q5_0):
    """22 bytes: ``d`` fp16 | ``qh`` (bit 4 of each quant) | 16 nibble bytes. ``d = max / -16``."""

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        d, q = _offset_quants(blocks, 16)
        return torch.cat((fp16_bytes(d), _high_bits(q), _nibbles(q)), dim=1)


class Q5_1(BlockQuantizer, qtype=T.Q5_1):
    """24 bytes: ``d`` | ``m`` fp16 | ``qh`` | 16 nibble bytes. ``d = (max-min)/31``, ``m = min``."""

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        mn, mx = _min_max(blocks)
        d = (mx - mn) / 31
        q = torch.trunc((blocks - mn[:, None]) * _inverse(d)[:, None] + 0.5).clamp_(0, 31).to(torch.int32)
        return torch.cat((fp16_bytes(d), fp16_bytes(mn), _high_bits(q), _nibbles(q)), dim=1)
