"""The k-quants: 256-weight super-blocks split into 16 or 8 sub-blocks with their own scales.

Q2_K, Q3_K and Q6_K have 16 sub-blocks of 16 weights; Q4_K and Q5_K have 8 sub-blocks of 32.
Low bits are packed in "planes": a run of 32 bytes holds 32 consecutive elements in its low
bits, the next 32 elements in the next bit field of the same bytes, and so on.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from ._base import BlockType, f16, nibbles, split, unpack


class Q2_K(BlockType, qtype=T.Q2_K):
    """84 bytes / 256 weights: ``scales`` (16) | ``qs`` 2-bit (64) | ``d`` fp16 | ``dmin`` fp16.

    Each scale byte is ``m << 4 | s`` for one sub-block of 16; ``w = (d*s) * q - (dmin*m)``.
    ``qs`` is two runs of 32 bytes, each holding 4 planes of 2 bits (128 weights).
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        scales, qs, d, dmin = split(blocks, 16, 64, 2, 2)
        dl = f16(d) * (scales & 0x0F).to(torch.float32)
        ml = f16(dmin) * (scales >> 4).to(torch.float32)
        q = unpack(qs.reshape(n, 2, 32), 2, dim=2).reshape(n, 16, 16).to(torch.float32)
        return q.mul_(dl[:, :, None]).sub_(ml[:, :, None]).reshape(n, 256)


class Q3_K(BlockType, qtype=T.Q3_K):
    """110 bytes / 256 weights: ``hmask`` (32) | ``qs`` 2-bit (64) | ``scales`` (12) | ``d`` fp16.

    ``q = low2 - 4 * (1 - hbit)`` with ``hbit`` bit ``k`` of ``hmask`` for elements
    ``32k..32k+31``; the 16 six-bit scales are the nibbles of bytes 0..7 (low nibbles first)
    topped with 2-bit fields of bytes 8..11, minus 32; ``w = (d * scale) * q``.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        hmask, qs, scales, d = split(blocks, 32, 64, 12, 2)
        low = nibbles(scales[:, :8], dim=1).reshape(n, 16)
        high = unpack(scales[:, 8:], 2, dim=1).reshape(n, 16)
        sc = (low | (high << 4)).to(torch.int8) - 32
        dl = f16(d) * sc.to(torch.float32)
        ql = unpack(qs.reshape(n, 2, 32), 2, dim=2).reshape(n, 16, 16).to(torch.int8)
        hb = unpack(hmask, 1, dim=1).reshape(n, 16, 16)
        q = ql - ((hb ^ 1) << 2).to(torch.int8)
        return q.to(torch.float32).mul_(dl[:, :, None]).reshape(n, 256)


def scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins packed in the 12 bytes of Q4_K / Q5_K.

    Bytes 0..3 hold scales 0..3 (low 6 bits), bytes 4..7 mins 0..3; bytes 8..11 hold the low
    nibbles of scales 4..7 and mins 4..7 (high nibble), whose top 2 bits are the spare top
    bits of bytes 0..3 and 4..7.
    """
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), dim=1)
    mn = torch.cat((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), dim=1)
    return sc, mn


def _k4_scales(d: torch.Tensor, dmin: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc, mn = scale_min_k4(scales)
    dl = f16(d) * sc.to(torch.float32)
    ml = f16(dmin) * mn.to(torch.float32)
    return dl[:, :, None], ml[:, :, None]


class Q4_K(BlockType, qtype=T.Q4_K):
    """144 bytes / 256 weights: ``d`` fp16 | ``dmin`` fp16 | ``scales`` (12) | ``qs`` 4-bit (128).

    ``qs`` is 4 runs of 32 bytes: low nibbles are one sub-block of 32, high nibbles the next.
    ``w = (d*sc) * q - (dmin*m)``.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, dmin, scales, qs = split(blocks, 2, 2, 12, 128)
        dl, ml = _k4_scales(d, dmin, scales)
        q = nibbles(qs.reshape(n, 4, 32), dim=2).reshape(n, 8, 32).to(torch.float32)
        return q.mul_(dl).sub_(ml).reshape(n, 256)


class Q5_K(BlockType, qtype=T.Q5_K):
    """176 bytes / 256 weights: ``d`` | ``dmin`` | ``scales`` (12) | ``qh`` (32) | ``qs`` (128).

    As Q4_K, with a fifth bit per weight: bit ``k`` of ``qh`` is for sub-block ``k``.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, dmin, scales, qh, qs = split(blocks, 2, 2, 12, 32, 128)
        dl, ml = _k4_scales(d, dmin, scales)
        low = nibbles(qs.reshape(n, 4, 32), dim=2).reshape(n, 8, 32)
        high = unpack(qh, 1, dim=1)  # (n, 8, 32)
        q = (low | (high << 4)).to(torch.float32)
        return q.mul_(dl).sub_(ml).reshape(n, 256)


class Q6_K(BlockType, qtype=T.Q6_K):
    """210 bytes / 256 weights: ``ql`` 4-bit (128) | ``qh`` 2-bit (64) | ``scales`` int8 (16) | ``d`` fp16.

    Each half (128 weights) uses 64 ``ql`` bytes (low nibbles, then high nibbles) and 32
    ``qh`` bytes (4 planes of 2 bits); ``w = (d * scale) * (q - 32)``.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        ql, qh, scales, d = split(blocks, 128, 64, 16, 2)
        dl = f16(d) * scales.contiguous().view(torch.int8).to(torch.float32)
        low = nibbles(ql.reshape(n, 2, 64), dim=2).reshape(n, 256)
        high = unpack(qh.reshape(n, 2, 32), 2, dim=2).reshape(n, 256)
        q = (low | (high << 4)).to(torch.int8) - 32
        return q.to(torch.float32).reshape(n, 16, 16).mul_(dl[:, :, None]).reshape(n, 256)
