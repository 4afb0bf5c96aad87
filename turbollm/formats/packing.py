"""Bit packing of small integer codes: our nibble and 3-bit layouts and the int32 words of GPTQ/AWQ files.

- Internal int4 layout (``kernels/quant.py``): uint8 ``[N, K/2]``, low nibble = even column
  (also holds 2-bit codes, at 4 bits each).
- Internal 3-bit layout (`pack_3bit`): uint8 ``[N, K/32*12]``, 12 bytes per block of 32 codes
  (K a multiple of 32): 8 bytes of the codes' low 2 bits, then 4 bytes of their bit 2.
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


def pack_3bit(q: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., K]`` in 0..7 (K a multiple of 32) → uint8 ``[..., K/32*12]``.

    Per block of 32 codes c_0..c_31 (columns 32b..32b+31), 12 bytes:
    - bytes 0..7: byte j holds the low 2 bits of c_j, c_{j+8}, c_{j+16}, c_{j+24} at bit
      shifts 0, 2, 4, 6;
    - bytes 8..11: a little-endian uint32 whose bit i is bit 2 of c_i.
    (The order suits AVX2: the 8 low bytes as one uint64 shifted right by 0/2/4/6 in its four
    64-bit lanes, masked with 3, give c_0..c_31 in byte order; csrc/quant_dot_int.cpp.)
    """
    k = q.shape[-1]
    if k % 32:
        raise ValueError(f"pack_3bit: K = {k} is not a multiple of 32")
    q = q.to(torch.uint8).reshape(*q.shape[:-1], k // 32, 4, 8)  # [..., block, r, j]: code 8r + j
    low = q & 3
    lo = low[..., 0, :] | (low[..., 1, :] << 2) | (low[..., 2, :] << 4) | (low[..., 3, :] << 6)  # [..., B, 8]
    bit2 = (q >> 2) & 1  # bit 2 of code 8r + j goes to bit j of high byte r
    hi = bit2[..., 0]
    for j in range(1, 8):
        hi = hi | (bit2[..., j] << j)  # [..., B, 4]
    return torch.cat([lo, hi], dim=-1).reshape(*q.shape[:-3], k // 32 * 12)


def unpack_3bit(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/32*12]`` → uint8 codes ``[..., K]`` (inverse of `pack_3bit`)."""
    nb = packed.shape[-1]
    if nb % 12:
        raise ValueError(f"unpack_3bit: {nb} bytes per row is not a whole number of 12-byte blocks")
    p = packed.reshape(*packed.shape[:-1], nb // 12, 12)
    lo, hi = p[..., :8], p[..., 8:]
    low = torch.stack([(lo >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)  # [..., B, r, j]
    bit2 = torch.stack([(hi >> j) & 1 for j in range(8)], dim=-1)  # [..., B, r, j]
    return (low | (bit2 << 2)).reshape(*packed.shape[:-1], nb // 12 * 32)


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
