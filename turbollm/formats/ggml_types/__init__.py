"""Decoding of GGUF tensor data (every ggml float and block-quantized type) into PyTorch.

``dequantize(data, qtype, shape)`` turns the raw bytes of one GGUF tensor into a float32
tensor of ``shape`` (PyTorch order: the reverse of GGUF's ``ne``). Results are bit for bit
those of gguf-py's numpy reference ``gguf.quants.dequantize``; see ``_base`` for how.

The work is done in chunks of whole blocks (``chunk_elements`` weights at a time), written
into one preallocated output, so peak memory is the output plus a few chunk-sized
intermediates, whatever the tensor size. ``dequantize_rows`` decodes only selected rows (an
embedding lookup on a quantized table, for instance).

Decoders are registered per type in ``_base.REGISTRY`` by the family modules ``legacy``
(floats, Q4_0..Q8_0), ``kquants`` (Q2_K..Q6_K), ``iquants`` (IQ*), ``ternary`` (TQ*) and
``fp4`` (MXFP4, NVFP4). A type without a decoder raises ``UnsupportedTensorTypeError``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ...errors import ModelFormatError, UnsupportedTensorTypeError
from . import fp4, iquants, kquants, legacy, ternary  # noqa: F401  (registers the decoders)
from ._base import REGISTRY, BlockType

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "SUPPORTED_TYPES",
    "BlockType",
    "block_size_bytes",
    "dequantize",
    "dequantize_rows",
    "is_supported",
    "tensor_nbytes",
]

#: Types ``dequantize`` can decode.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(REGISTRY)

#: Weights decoded per chunk by default (4 MiB of float32 output per step).
DEFAULT_CHUNK_ELEMENTS = 1 << 20

QType = int | GGMLQuantizationType


def _type_name(qtype: QType) -> str:
    try:
        return GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return str(int(qtype))


def _decoder(qtype: QType, tensor_name: str) -> type[BlockType]:
    try:
        return REGISTRY[GGMLQuantizationType(int(qtype))]
    except (ValueError, KeyError):
        raise UnsupportedTensorTypeError(
            f"unsupported GGUF type {_type_name(qtype)} in tensor {tensor_name}"
        ) from None


def is_supported(qtype: QType) -> bool:
    """Whether ``dequantize`` can decode GGUF type ``qtype`` (an id or enum member)."""
    try:
        return GGMLQuantizationType(int(qtype)) in REGISTRY
    except ValueError:
        return False


def block_size_bytes(qtype: QType) -> tuple[int, int]:
    """``(elements_per_block, bytes_per_block)`` of any type gguf knows, decodable or not."""
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(int(qtype))]
    except (ValueError, KeyError):
        raise UnsupportedTensorTypeError(f"unsupported GGUF type {_type_name(qtype)}") from None


def tensor_nbytes(qtype: QType, shape: Sequence[int]) -> int:
    """Bytes a tensor of ``shape`` (PyTorch order) takes in GGUF type ``qtype``."""
    block_size, type_size = block_size_bytes(qtype)
    return math.prod(shape) // block_size * type_size


def _as_bytes(data: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A flat uint8 view (a copy only if ``data`` is not contiguous) of a tensor or array."""
    if isinstance(data, np.ndarray):
        with warnings.catch_warnings():  # read-only memmaps: we never write through the view
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(data))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy array, got {type(data).__name__}")
    flat = data.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _check_layout(decoder: type[BlockType], raw: torch.Tensor, shape: tuple[int, ...], tensor_name: str) -> int:
    """Validate ``shape`` against the type and byte count; return the number of blocks."""
    name = decoder.qtype.name
    numel = math.prod(shape)
    row = shape[-1] if shape else 1
    if row % decoder.block_size:
        raise ModelFormatError(
            f"tensor {tensor_name}: rows of {row} elements are not whole {name} blocks of {decoder.block_size}"
        )
    n_blocks = numel // decoder.block_size
    if raw.numel() != n_blocks * decoder.type_size:
        raise ModelFormatError(
            f"tensor {tensor_name}: {name} shape {list(shape)} needs {n_blocks * decoder.type_size} bytes, "
            f"got {raw.numel()}"
        )
    return n_blocks


def dequantize(
    data: torch.Tensor | np.ndarray,
    qtype: QType,
    shape: Sequence[int],
    *,
    tensor_name: str = "?",
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Decode the raw GGUF bytes of one tensor into a tensor of ``shape``.

    ``data`` is the tensor's storage as read from the file: a uint8 byte tensor / array, or
    for the float types also a typed one (float32, float16...); it is never written to.
    ``shape`` is in PyTorch order (rows, cols). The values are computed in float32 and are
    those of ``gguf.quants.dequantize``; with another ``dtype`` (or an ``out`` of another
    floating dtype) each chunk is rounded to it as it is written, so no full float32 copy is
    ever held. ``chunk_elements`` bounds the weights decoded per step.

    Raises UnsupportedTensorTypeError for types without a decoder and ModelFormatError when
    the byte count or the row length does not fit ``shape``.
    """
    decoder = _decoder(qtype, tensor_name)
    shape = tuple(int(s) for s in shape)
    raw = _as_bytes(data)
    n_blocks = _check_layout(decoder, raw, shape, tensor_name)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif tuple(out.shape) != shape or not out.is_contiguous() or not out.is_floating_point():
        raise ValueError(f"out must be a contiguous floating tensor of shape {list(shape)}, got {out.dtype} {list(out.shape)}")
    if n_blocks == 0:
        return out
    blocks = raw.view(n_blocks, decoder.type_size)
    flat_out = out.view(n_blocks, decoder.block_size)
    step = max(1, chunk_elements // decoder.block_size)
    for start in range(0, n_blocks, step):
        stop = min(start + step, n_blocks)
        flat_out[start:stop].copy_(decoder.decode(blocks[start:stop]))
    return out


def dequantize_rows(
    data: torch.Tensor | np.ndarray,
    qtype: QType,
    shape: Sequence[int],
    rows: torch.Tensor | Sequence[int] | slice,
    *,
    tensor_name: str = "?",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode only ``rows`` of a tensor viewed as ``(-1, shape[-1])``; returns ``(k, shape[-1])``.

    ``rows`` is an index tensor / sequence (as for an embedding lookup) or a slice. Values are
    identical to the same rows of ``dequantize``.
    """
    decoder = _decoder(qtype, tensor_name)
    shape = tuple(int(s) for s in shape)
    raw = _as_bytes(data)
    _check_layout(decoder, raw, shape, tensor_name)
    cols = shape[-1] if shape else 1
    n_rows = math.prod(shape) // cols if cols else 0
    table = raw.view(n_rows, cols // decoder.block_size * decoder.type_size)
    if isinstance(rows, slice):
        picked = table[rows]
    else:
        index = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
        if index.numel() and (int(index.min()) < -n_rows or int(index.max()) >= n_rows):
            raise IndexError(f"row index out of range for tensor {tensor_name} with {n_rows} rows")
        picked = table[index]
    return dequantize(picked, qtype, (picked.shape[0], cols), tensor_name=tensor_name, dtype=dtype)
