"""GGML block encoders: float32 weights -> the raw bytes of a GGUF tensor, per GGML type.

``quantize(data, qtype)`` encodes a tensor whose rows are whole blocks of ``qtype`` and
returns uint8 ``(*shape[:-1], row_bytes)``, the layout ``gguf.GGUFWriter`` stores and
``turbollm.formats.ggml_types.dequantize`` decodes. Encoders are registered per type in
``_base.REGISTRY`` by the family modules ``legacy`` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0) and ``kquants`` (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); a type without an encoder raises
``UnsupportedTensorTypeError`` naming the ones there are.

They reproduce llama.cpp's reference quantizers (``ggml-quants.c``, the path taken without an
importance matrix) in vectorized float32; for the types gguf-py also implements
(``gguf.quants.quantize``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16) the bytes are identical to it.
The work runs in chunks of ``chunk_elements`` weights, so intermediates stay bounded.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ...errors import UnsupportedTensorTypeError
from . import kquants, legacy  # noqa: F401  (registers the encoders)
from ._base import REGISTRY, BlockQuantizer

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "SUPPORTED_TYPES", "BlockQuantizer", "get_quantizer", "quantize"]

#: Types ``quantize`` can encode.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(REGISTRY)

#: Weights encoded per step by default.
DEFAULT_CHUNK_ELEMENTS = 1 << 20


def get_quantizer(qtype: int | GGMLQuantizationType | str) -> type[BlockQuantizer]:
    """The encoder class of ``qtype`` (a GGUF type id, enum member or name such as ``"Q4_K"``)."""
    try:
        key = GGMLQuantizationType[qtype.upper()] if isinstance(qtype, str) else GGMLQuantizationType(int(qtype))
        return REGISTRY[key]
    except (KeyError, ValueError):
        names = ", ".join(t.name for t in sorted(REGISTRY, key=lambda t: t.value))
        raise UnsupportedTensorTypeError(f"no GGML encoder for type {qtype!r}; the encodable types are {names}") from None


def quantize(
    data: torch.Tensor | np.ndarray,
    qtype: int | GGMLQuantizationType | str,
    *,
    tensor_name: str = "?",
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> np.ndarray:
    """Encode ``data`` (any float dtype, rows last) as GGML type ``qtype``; returns uint8 bytes.

    The result has shape ``(*data.shape[:-1], data.shape[-1] // block_size * type_size)``.
    Raises ValueError when the row length is not a multiple of the block size or the data
    holds inf / NaN (which no GGML type can carry through its fp16 scales).
    """
    enc = get_quantizer(qtype)
    t = torch.as_tensor(data).detach().to(torch.float32)
    shape = tuple(t.shape) or (1,)
    if shape[-1] % enc.block_size:
        raise ValueError(f"tensor {tensor_name}: rows of {shape[-1]} weights are not whole "
                         f"{enc.qtype.name} blocks of {enc.block_size}")
    blocks = t.reshape(-1, enc.block_size)
    n = blocks.shape[0]
    out = torch.empty((n, enc.type_size), dtype=torch.uint8)
    step = max(1, chunk_elements // enc.block_size)
    for start in range(0, n, step):
        chunk = blocks[start:start + step].contiguous()
        lo, hi = torch.aminmax(chunk)  # NaN propagates to both, inf shows as an extreme
        if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
            raise ValueError(f"tensor {tensor_name}: holds inf or NaN values; cannot encode as {enc.qtype.name}")
        out[start:start + step] = enc.quantize_blocks(chunk)
    row_bytes = shape[-1] // enc.block_size * enc.type_size
    return out.numpy().reshape(*shape[:-1], row_bytes)
