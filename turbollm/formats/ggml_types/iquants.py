"""The i-quants: non-linear 4-bit codebooks (IQ4_NL, IQ4_XS) and lattice codebooks (IQ1..IQ3).

IQ4_NL / IQ4_XS map each 4-bit code through ggml's fixed 16-entry table ``kvalues_iq4nl``.
The IQ1_*, IQ2_* and IQ3_* types store indices into lattice tables ("grids") of 8 or 4
values; the grids are taken at first use from the packed copies gguf-py ships
(``gguf.quants.IQ*.grid_hex``), signs come from explicit bits or from ggml's ``ksigns_iq2xs``
parity table. All these types are 256-weight super-blocks except IQ4_NL (32).
"""

from __future__ import annotations

from functools import cache

import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from ._base import BlockType, decode_grid, f16, ksigns_table, lookup, nibbles, sign_bits, split, u16, u32_bits, unpack

#: ggml's ``kvalues_iq4nl``.
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@cache
def _iq4_table() -> torch.Tensor:
    return torch.tensor(IQ4NL_VALUES, dtype=torch.float32)


@cache
def _ksigns() -> torch.Tensor:
    return ksigns_table()


@cache
def _grid(name: str) -> torch.Tensor:
    """The float32 lattice of gguf-py's class ``name`` (e.g. ``"IQ2_XXS"``), ``(entries, width)``."""
    ref = getattr(gguf_quants, name)
    return decode_grid(ref.grid_hex, ref.grid_map, ref.grid_shape)


def _iq2_sub_scales(d: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """IQ2_XS / IQ2_S: 16 four-bit scales (byte-major, low nibble first); ``(d*(0.5+s))*0.25``."""
    n = scales.shape[0]
    s = nibbles(scales, dim=2).reshape(n, 16).to(torch.float32)
    return (f16(d) * (s + 0.5)) * 0.25


class IQ4_NL(BlockType, qtype=T.IQ4_NL):
    """18 bytes / 32 weights: ``d`` fp16 | 32 x 4-bit codes (16, low nibbles first);
    ``w = d * kvalues[code]``."""

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs = split(blocks, 2, 16)
        q = lookup(_iq4_table(), nibbles(qs, dim=1).reshape(n, 32))
        return q.mul_(f16(d))


class IQ4_XS(BlockType, qtype=T.IQ4_XS):
    """136 bytes / 256 weights: ``d`` fp16 | ``scales_h`` uint16 | ``scales_l`` (4) | codes (128).

    Sub-block ``k`` of 32 has a 6-bit scale: nibble ``k`` of ``scales_l`` (byte-major, low
    first) | bits ``2k..2k+1`` of ``scales_h`` << 4, minus 32; ``w = (d * scale) * kvalues[code]``
    with codes packed per sub-block as in IQ4_NL.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, scales_h, scales_l, qs = split(blocks, 2, 2, 4, 128)
        low = nibbles(scales_l, dim=2).reshape(n, 8)
        high = unpack(u16(scales_h), 2, dim=-1, shifts=tuple(range(0, 16, 2))).reshape(n, 8)
        sc = (low.to(torch.int32) | (high << 4)) - 32
        dl = f16(d) * sc.to(torch.float32)
        codes = nibbles(qs.reshape(n, 8, 16), dim=2).reshape(n, 8, 32)
        return lookup(_iq4_table(), codes).mul_(dl[:, :, None]).reshape(n, 256)


class IQ2_XXS(BlockType, qtype=T.IQ2_XXS):
    """66 bytes / 256 weights: ``d`` fp16 | 8 x (uint32 ``grid``, uint32 ``aux``).

    Per sub-block of 32: the 4 bytes of ``grid`` index ``iq2xxs_grid`` (8 values each); ``aux``
    holds four 7-bit ``ksigns`` indices (bits 0..27) and a 4-bit scale ``s`` (bits 28..31);
    ``w = ((d * (0.5 + s)) * 0.25) * grid * sign``.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs = split(blocks, 2, 64)
        words = qs.reshape(n, 8, 8)
        aux = u32_bits(words[:, :, 4:])  # (n, 8, 1)
        db = (f16(d) * (((aux >> 28) & 0x0F).to(torch.float32).reshape(n, 8) + 0.5)) * 0.25
        sidx = unpack(aux, 7, dim=-1, shifts=(0, 7, 14, 21)).reshape(n, 8, 4)
        grid = lookup(_grid("IQ2_XXS"), words[:, :, :4])  # (n, 8, 4, 8)
        out = grid.mul_(db[:, :, None, None]).mul_(lookup(_ksigns(), sidx))
        return out.reshape(n, 256)


class IQ2_XS(BlockType, qtype=T.IQ2_XS):
    """74 bytes / 256 weights: ``d`` fp16 | 32 x uint16 ``qs`` (64) | ``scales`` 4-bit (8).

    Each uint16 is a 9-bit index into ``iq2xs_grid`` (8 values) and a 7-bit ``ksigns`` index;
    two of them share a 4-bit scale ``s``: ``w = ((d * (0.5 + s)) * 0.25) * grid * sign``.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs, scales = split(blocks, 2, 64, 8)
        db = _iq2_sub_scales(d, scales)
        q = u16(qs)  # (n, 32)
        grid = lookup(_grid("IQ2_XS"), q & 511).reshape(n, 16, 2, 8)
        signs = lookup(_ksigns(), q >> 9).reshape(n, 16, 2, 8)
        return grid.mul_(db[:, :, None, None]).mul_(signs).reshape(n, 256)


class IQ2_S(BlockType, qtype=T.IQ2_S):
    """82 bytes / 256 weights: ``d`` fp16 | ``qs`` (32) | ``signs`` (32) | ``qh`` (8) | ``scales`` (8).

    Grid index ``j`` (10 bits, ``iq2s_grid``) is ``qs[j]`` | 2-bit field ``j % 4`` of
    ``qh[j // 4]`` << 8; sign bits are explicit; scales as IQ2_XS.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs, signs, qh, scales = split(blocks, 2, 32, 32, 8, 8)
        db = _iq2_sub_scales(d, scales)
        high = unpack(qh, 2, dim=-1).reshape(n, 32).to(torch.int32)
        grid = lookup(_grid("IQ2_S"), qs.to(torch.int32) | (high << 8)).reshape(n, 16, 2, 8)
        sgn = sign_bits(signs).reshape(n, 16, 2, 8)
        return grid.mul_(db[:, :, None, None]).mul_(sgn).reshape(n, 256)


class IQ3_XXS(BlockType, qtype=T.IQ3_XXS):
    """98 bytes / 256 weights: ``d`` fp16 | ``qs`` (64) | 8 x uint32 ``aux`` (32).

    Each ``qs`` byte indexes ``iq3xxs_grid`` (4 values); ``aux`` of sub-block ``k`` holds four
    7-bit ``ksigns`` indices and a 4-bit scale ``s``: ``w = ((d * (0.5 + s)) * 0.5) * grid * sign``.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs, scales = split(blocks, 2, 64, 32)
        aux = u32_bits(scales)  # (n, 8)
        db = (f16(d) * (((aux >> 28) & 0x0F).to(torch.float32) + 0.5)) * 0.5
        sidx = unpack(aux, 7, dim=-1, shifts=(0, 7, 14, 21))  # (n, 8, 4)
        grid = lookup(_grid("IQ3_XXS"), qs).reshape(n, 8, 4, 8)
        return grid.mul_(db[:, :, None, None]).mul_(lookup(_ksigns(), sidx)).reshape(n, 256)


class IQ3_S(BlockType, qtype=T.IQ3_S):
    """110 bytes / 256 weights: ``d`` fp16 | ``qs`` (64) | ``qh`` (8) | ``signs`` (32) | ``scales`` (4).

    Grid index ``j`` (9 bits, ``iq3s_grid``, 4 values) is ``qs[j]`` | bit ``j % 8`` of
    ``qh[j // 8]`` << 8; sign bits are explicit; sub-block ``k`` of 32 has the 4-bit scale
    nibble ``k`` (byte-major, low first): ``w = (d * (1 + 2s)) * grid * sign``.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs, qh, signs, scales = split(blocks, 2, 64, 8, 32, 4)
        s = nibbles(scales, dim=2).reshape(n, 8)
        db = f16(d) * (2 * s + 1).to(torch.float32)
        high = unpack(qh, 1, dim=-1).reshape(n, 64).to(torch.int32)
        grid = lookup(_grid("IQ3_S"), qs.to(torch.int32) | (high << 8)).reshape(n, 8, 4, 8)
        sgn = sign_bits(signs).reshape(n, 8, 4, 8)
        return grid.mul_(db[:, :, None, None]).mul_(sgn).reshape(n, 256)


_IQ1_DELTA = 0.125


class IQ1_S(BlockType, qtype=T.IQ1_S):
    """50 bytes / 256 weights: ``d`` fp16 | ``qs`` (32) | 8 x uint16 ``qh`` (16).

    Grid index ``j`` (11 bits, ``iq1s_grid`` of -1/0/1) is ``qs[j]`` | 3-bit field ``j % 4`` of
    ``qh[j // 4]`` << 8; bits 12..14 of ``qh[k]`` are a scale ``s`` and bit 15 the sign of the
    shift ``delta`` = +-0.125: ``w = (d * (2s + 1)) * (grid + delta)``.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs, qh = split(blocks, 2, 32, 16)
        h = u16(qh)  # (n, 8)
        dl = f16(d) * (2 * ((h >> 12) & 7) + 1).to(torch.float32)
        delta = torch.where((h & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA)
        high = unpack(h, 3, dim=-1, shifts=(0, 3, 6, 9)).reshape(n, 32)
        grid = lookup(_grid("IQ1_S"), qs.to(torch.int32) | (high << 8)).reshape(n, 8, 4, 8)
        return grid.add_(delta[:, :, None, None]).mul_(dl[:, :, None, None]).reshape(n, 256)


class IQ1_M(BlockType, qtype=T.IQ1_M):
    """56 bytes / 256 weights: ``qs`` (32) | ``qh`` (16) | 4 x uint16 ``scales`` (8); no ``d`` field.

    The fp16 ``d`` is spread over the top nibbles of the four scale words (word 0 holds its
    lowest nibble); the remaining 12 bits of each word are four 3-bit scales ``s``, one per 16
    weights. Each ``qh`` nibble gives 3 high bits of an 11-bit ``iq1s_grid`` index and, in its
    top bit, the sign of ``delta``: ``w = (d * (2s + 1)) * (grid + delta)``.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        qs, qh, scales = split(blocks, 32, 16, 8)
        sw = u16(scales)  # (n, 4)
        dbits = (sw[:, 0] >> 12) | ((sw[:, 1] >> 8) & 0xF0) | ((sw[:, 2] >> 4) & 0xF00) | (sw[:, 3] & 0xF000)
        d = dbits.to(torch.int16).view(torch.float16).to(torch.float32)
        s = unpack(sw, 3, dim=-1, shifts=(0, 3, 6, 9)).reshape(n, 16)
        dl = d[:, None] * (2 * s + 1).to(torch.float32)
        nib = nibbles(qh, dim=-1).reshape(n, 32)
        delta = torch.where((nib & 0x08) == 0, _IQ1_DELTA, -_IQ1_DELTA)
        idx = qs.to(torch.int32) | ((nib & 0x07).to(torch.int32) << 8)
        grid = lookup(_grid("IQ1_S"), idx)  # IQ1_M shares iq1s_grid
        grid = grid.reshape(n, 8, 2, 2, 8).add_(delta.reshape(n, 8, 2, 2, 1))
        return grid.mul_(dl.reshape(n, 8, 2, 1, 1)).reshape(n, 256)
