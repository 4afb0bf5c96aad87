"""Shared machinery of the GGML block encoders: the registry, the base class, float32 helpers.

An encoder is a subclass of :class:`BlockQuantizer` declared with a ``qtype=`` keyword; the
subclass hook records it in :data:`REGISTRY`, keyed by ``gguf.GGMLQuantizationType``. It gets
a float32 tensor ``(n_blocks, block_size)`` and returns the raw GGML bytes ``(n_blocks,
type_size)`` as uint8, the layout ``turbollm.formats.ggml_types`` decodes.

The encoders reproduce llama.cpp's reference (non-imatrix) quantizers of ``ggml-quants.c``
(``quantize_row_*_ref``) operation for operation in float32: every product, quotient and sum
is rounded once, in the C order (``w*x*l`` is ``(w*x)*l``), sums over a group run element by
element from the first (see :func:`seq_sum`), rounding to an integer is ggml's
``nearest_int`` bit trick (:func:`nearest_int`) and scalar constants are float32 values.
Nothing is fused or reassociated; two torch shortcuts that round differently are avoided
(:func:`rdiv`, :func:`sqrt_f32`). The work is vectorized over blocks / sub-blocks: a group of
``n`` weights is a column of an ``(n, groups)`` tensor, so one torch op handles every group.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

#: Every type we can encode, keyed by its GGUF type id; filled by ``BlockQuantizer`` subclasses.
REGISTRY: dict[GGMLQuantizationType, type[BlockQuantizer]] = {}


class BlockQuantizer:
    """Base class of a block encoder; subclass with ``class X(BlockQuantizer, qtype=...)``.

    ``block_size`` (weights per block) and ``type_size`` (bytes per block) come from
    ``gguf.GGML_QUANT_SIZES``; a subclass documents which llama.cpp routine it follows.
    """

    qtype: ClassVar[GGMLQuantizationType]
    block_size: ClassVar[int]
    type_size: ClassVar[int]

    def __init_subclass__(cls, qtype: GGMLQuantizationType, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.qtype = qtype
        cls.block_size, cls.type_size = GGML_QUANT_SIZES[qtype]
        if qtype in REGISTRY:
            raise TypeError(f"two encoders for {qtype.name}")
        REGISTRY[qtype] = cls

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        """Encode float32 ``(n_blocks, block_size)`` into uint8 ``(n_blocks, type_size)``."""
        raise NotImplementedError


def f32(value: float) -> float:
    """``value`` rounded to float32, as a Python float (exactly representable in float32)."""
    return float(np.float32(value))


def rdiv(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """``numerator / t`` in float32 with one rounding.

    (``scalar / tensor`` in torch computes ``reciprocal(t) * scalar``, which rounds twice.)
    """
    return torch.full_like(t, numerator) / t


def sqrt_f32(t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 ``sqrtf`` (torch's float32 sqrt kernel is not, on AVX2)."""
    return t.to(torch.float64).sqrt_().to(torch.float32)


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml's ``nearest_int``: add 1.5 * 2**23 in float32 and read the low mantissa bits.

    Rounds half to even for ``|v| < 2**22``; out of that range (and for inf / NaN) it returns
    the same wrapped integers the C code does. Returns int32; ``v`` is left alone.
    """
    return nearest_int_(v.to(torch.float32) + 12582912.0, shifted=True)


def nearest_int_(v: torch.Tensor, *, shifted: bool = False) -> torch.Tensor:
    """:func:`nearest_int` computed in the storage of the float32 temporary ``v`` (consumed).

    ``shifted`` says ``v`` already holds ``value + 1.5 * 2**23``. (Working in place matters:
    fresh multi-megabyte temporaries cost more than the arithmetic.)
    """
    if not shifted:
        v.add_(12582912.0)
    return v.view(torch.int32).bitwise_and_(0x007FFFFF).sub_(0x00400000)


def seq_sum(t: torch.Tensor, *, from_first: bool = False) -> torch.Tensor:
    """Sum ``t`` over dim 0 one row at a time, in float32, like a C ``for`` loop.

    ``from_first`` starts from ``t[0]`` (C: ``float s = a[0]; for (i = 1; ...)``), otherwise
    from ``+0.0`` (C: ``float s = 0; for (i = 0; ...)``); they differ only in the sign of a
    zero sum.
    """
    if from_first:
        acc = t[0].clone()
        rows = range(1, t.shape[0])
    else:
        acc = torch.zeros_like(t[0])
        rows = range(t.shape[0])
    for i in rows:
        acc += t[i]
    return acc


def first_absmax(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, max)`` over ``dim``: the largest ``|x|`` and the signed value holding it.

    Ties go to the first index, as in the C loops ``if (ax > amax) { amax = ax; max = x; }``.
    """
    ax = x.abs()
    idx = ax.argmax(dim=dim, keepdim=True)
    return ax.gather(dim, idx).squeeze(dim), x.gather(dim, idx).squeeze(dim)


def fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 ``(n,)`` -> the little-endian bytes ``(n, 2)`` of its fp16 rounding (nearest even)."""
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def fp16_round(v: torch.Tensor) -> torch.Tensor:
    """``GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v))``: float32 rounded through fp16."""
    return v.to(torch.float16).to(torch.float32)


def as_u8(v: torch.Tensor) -> torch.Tensor:
    """Low 8 bits of an integer tensor as uint8 (C's conversion of an int to ``uint8_t``)."""
    return (v & 0xFF).to(torch.uint8)


def as_i8(v: torch.Tensor) -> torch.Tensor:
    """An integer tensor wrapped to int8 (C's conversion of an int to ``int8_t``), as int32."""
    return ((v + 128) & 0xFF) - 128


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``8 // bits`` planes along dim -2 into the bit fields of one byte.

    ``q`` has shape ``(..., 8 // bits, m)`` of values below ``2**bits``; plane ``k`` lands in
    bits ``k*bits .. k*bits + bits - 1`` of the ``m`` output bytes.
    """
    planes = 8 // bits
    out = torch.zeros(q.shape[:-2] + q.shape[-1:], dtype=torch.int32)
    for k in range(planes):
        out |= q[..., k, :].to(torch.int32) << (k * bits)
    return out.to(torch.uint8)
