"""Shared machinery of the GGUF block decoders: the registry, the base class and byte helpers.

Every block type is a subclass of :class:`BlockType` declared with a ``qtype=`` keyword; the
subclass hook records it in :data:`REGISTRY`, keyed by ``gguf.GGMLQuantizationType``, so the
public functions in ``__init__`` look a type up instead of branching on its name.

A decoder receives a uint8 tensor of shape ``(n_blocks, type_size)`` (the raw bytes of ``n``
consecutive blocks) and returns a float32 tensor of shape ``(n_blocks, block_size)``. Decoders
keep their integer intermediates in uint8 / int16 / int32 and are called on bounded chunks of
blocks, so that no intermediate grows with the size of the tensor.

The results must equal gguf-py's numpy reference (``gguf.quants.dequantize``) bit for bit, so
each decoder performs the same float32 operations in the same order as that reference: fp16
fields are widened to float32 first, then products are taken one rounding at a time (for
example ``(d * q) - m``, never a fused or reassociated form).

Multi-byte fields are read through dtype views of the byte tensor, which assumes a
little-endian host (every platform PyTorch ships for); GGUF files are little-endian.
"""

from __future__ import annotations

from math import ceil, log2
from typing import ClassVar

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

#: Every decodable block type, keyed by its GGUF type id; filled by ``BlockType`` subclasses.
REGISTRY: dict[GGMLQuantizationType, type[BlockType]] = {}


class BlockType:
    """Base class of a block decoder; subclass with ``class X(BlockType, qtype=...)``.

    ``block_size`` (elements per block) and ``type_size`` (bytes per block) are filled in from
    ``gguf.GGML_QUANT_SIZES``; a subclass documents its byte layout in its docstring.
    """

    qtype: ClassVar[GGMLQuantizationType]
    block_size: ClassVar[int]
    type_size: ClassVar[int]

    def __init_subclass__(cls, *, qtype: GGMLQuantizationType, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if qtype in REGISTRY:
            raise RuntimeError(f"GGUF type {qtype.name} registered twice ({REGISTRY[qtype].__name__}, {cls.__name__})")
        cls.qtype = qtype
        cls.block_size, cls.type_size = GGML_QUANT_SIZES[qtype]
        REGISTRY[qtype] = cls

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        """Decode uint8 ``(n, type_size)`` blocks into float32 ``(n, block_size)`` values."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# byte helpers


def split(blocks: torch.Tensor, *widths: int) -> list[torch.Tensor]:
    """Cut ``(n, type_size)`` blocks into column views of the given byte widths."""
    assert sum(widths) == blocks.shape[-1], (widths, blocks.shape)
    parts, start = [], 0
    for width in widths:
        parts.append(blocks[:, start : start + width])
        start += width
    return parts


def f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 fields ``(n, 2k)`` bytes -> float32 ``(n, k)`` (exact widening)."""
    return raw.contiguous().view(torch.float16).to(torch.float32)


def u16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian uint16 fields ``(n, 2k)`` bytes -> int32 ``(n, k)`` in [0, 65535]."""
    return raw.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def u32_bits(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian 32-bit fields ``(n, 4k)`` bytes -> int32 ``(n, k)`` holding the same bits.

    Values with the top bit set read as negative; callers shift and then mask, which yields
    the same bit fields as an unsigned shift would.
    """
    return raw.contiguous().view(torch.int32)


def unpack(x: torch.Tensor, bits: int, dim: int, shifts: tuple[int, ...] | None = None) -> torch.Tensor:
    """Split each integer of ``x`` into ``bits``-wide fields, stacked along a new axis ``dim``.

    Fields are taken from the low bits up (shifts 0, bits, 2*bits, ... unless ``shifts`` is
    given); the dtype of ``x`` is kept.
    """
    mask = (1 << bits) - 1
    if shifts is None:
        shifts = tuple(range(0, 8 * x.element_size(), bits))
    return torch.stack([(x >> s) & mask if s else x & mask for s in shifts], dim=dim)


def nibbles(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Low and high nibbles of uint8 ``x`` stacked along a new axis ``dim`` (low first)."""
    return torch.stack((x & 0x0F, x >> 4), dim=dim)


def lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a small integer index tensor of any integer dtype."""
    return table[index.to(torch.int32)]


def ksigns_table() -> torch.Tensor:
    """The 128 x 8 sign patterns (+1 / -1, float32) of ggml's ``ksigns_iq2xs``.

    Entry ``i`` holds the seven bits of ``i`` plus an eighth bit that makes the parity even;
    bit ``k`` set means element ``k`` is negated.
    """
    codes = [i | ((bin(i).count("1") & 1) << 7) for i in range(128)]
    bits = [[(c >> k) & 1 for k in range(8)] for c in codes]
    return 1.0 - 2.0 * torch.tensor(bits, dtype=torch.float32)


def sign_bits(x: torch.Tensor) -> torch.Tensor:
    """Explicit sign bits: uint8 ``(..., m)`` -> float32 ``(..., m, 8)`` of +1 (bit clear) / -1."""
    bits = unpack(x, 1, dim=-1)
    return torch.where(bits == 0, 1.0, -1.0)


def decode_grid(grid_hex: bytes, grid_map: tuple[int | float, ...], grid_shape: tuple[int, int]) -> torch.Tensor:
    """Expand one of gguf-py's packed lattice tables (``IQ*.grid_hex``) into float32.

    The hex string decodes to bytes; each byte packs ``8 // bits`` indices of
    ``bits = ceil(log2(len(grid_map)))`` bits, taken at shifts 0, 8 // per_byte, ... from the
    low end; each index selects a value of ``grid_map``.
    """
    bits = ceil(log2(len(grid_map)))
    per_byte = 8 // bits
    raw = torch.frombuffer(bytearray(bytes.fromhex(grid_hex.decode("ascii"))), dtype=torch.uint8)
    idx = unpack(raw, bits, dim=-1, shifts=tuple(range(0, 8, 8 // per_byte)))
    values = torch.tensor(grid_map, dtype=torch.float32)
    return lookup(values, idx).reshape(grid_shape)
