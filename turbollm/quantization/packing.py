"""Bit packing of small integer codes: our nibble layout and the int32 words of GPTQ/AWQ files.

- Internal int4 layout (``kernels/quant.py``): uint8 ``[N, K/2]``, low nibble = even column.
  3-bit codes (0..7) use the same container, so they cost 4 bits of storage per weight.
- Checkpoint layouts pack codes into int32 words as a *little-endian bit stream*: value i of a
  run occupies bits ``[i*b, (i+1)*b)`` of the run's words, word 0 holding the lowest bits.
  For b = 2, 4, 8 this is the usual "value i at shift i*b"; for b = 3 it is AutoGPTQ's
  scheme of 32 values in 3 words, where values 10 and 21 straddle a word boundary.
- AWQ's GEMM layout additionally interleaves the 8 nibbles of each word (``AWQ_ORDER``).
"""

from __future__ import annotations

import torch

#: AutoAWQ "gemm" packing: nibble i of a word holds column ``8*c + AWQ_ORDER[i]``.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: Its inverse: column ``8*c + j`` sits in nibble ``AWQ_REVERSE_ORDER[j]``.
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

_MASK32 = (1 << 32) - 1


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes ``[N, K]`` in 0..15 (K even) → uint8 ``[N, K/2]``, low nibble = even column."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: K = {q.shape[-1]} is odd")
    q = q.to(torch.uint8)
    return (q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` → uint8 codes ``[N, K]`` (inverse of `pack_nibbles`)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def _bit_positions(count: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(count, dtype=torch.int64) * bits
    return offsets // 32, offsets % 32


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack codes (each < 2**bits) along `dim` into int32 words as a little-endian bit stream.

    The length along `dim` times `bits` must be a multiple of 32.
    """
    v = values.movedim(dim, -1).to(torch.int64)
    count = v.shape[-1]
    if (count * bits) % 32:
        raise ValueError(f"pack_int32: {count} values of {bits} bits do not fill whole 32-bit words")
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(f"pack_int32: codes outside [0, {(1 << bits) - 1}]")
    word, shift = _bit_positions(count, bits)
    words = torch.zeros(*v.shape[:-1], count * bits // 32, dtype=torch.int64)
    words.index_add_(-1, word, (v << shift) & _MASK32)  # disjoint bits: adding is OR-ing
    spill = shift + bits > 32
    if bool(spill.any()):
        words.index_add_(-1, word[spill] + 1, v[..., spill] >> (32 - shift[spill]))
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 words along `dim` → int64 codes along `dim`."""
    w = words.movedim(dim, -1).to(torch.int64) & _MASK32
    count = w.shape[-1] * 32 // bits
    word, shift = _bit_positions(count, bits)
    low = w[..., word] >> shift
    nxt = torch.clamp(word + 1, max=w.shape[-1] - 1)
    high = torch.where(shift + bits > 32, w[..., nxt] << (32 - shift), torch.zeros_like(low))
    return ((low | high) & ((1 << bits) - 1)).movedim(-1, dim).contiguous()


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[R, C]`` (C a multiple of 8) → AWQ "gemm" int32 ``[R, C/8]``."""
    r, c = values.shape
    grouped = values.reshape(r, c // 8, 8)[..., list(AWQ_ORDER)]
    return pack_int32(grouped.reshape(r, c), 4, dim=1)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ "gemm" int32 ``[R, C/8]`` → 4-bit codes ``[R, C]`` in column order."""
    r = words.shape[0]
    nib = unpack_int32(words, 4, dim=1).reshape(r, -1, 8)
    return nib[..., list(AWQ_REVERSE_ORDER)].reshape(r, -1)
