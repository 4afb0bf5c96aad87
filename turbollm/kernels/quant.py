"""Matrix products with weights that stay quantized in memory.

The one interface the quantized linear methods call. Each function has a plain PyTorch
reference (decode the weight with the bit-exact ``formats.ggml_types`` decoders, then an fp32
``F.linear``); the C++ kernels (``csrc/quant_*.cpp``) replace it where they exist, and tests
hold the two together.

Conventions
- A GGML-typed weight is ``w``: a uint8 tensor ``[N, row_bytes]`` holding the raw GGUF
  blocks of N rows (output features) of K columns (input features) each, row after row.
  ``qtype`` is the GGML type id (``gguf.GGMLQuantizationType`` value).
- ``x`` is float32 ``[M, K]`` (M tokens); results are float32 ``[M, N]``.
- int8 weight-only: ``w`` int8 ``[N, K]``, ``scale`` float32 ``[N]``; W = w * scale[:, None].
- int4 group-wise: ``packed`` uint8 ``[N, K // 2]`` (low nibble = even column), ``scales`` and
  ``zeros`` float32 ``[N, K // group]``; W[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turbollm.formats.ggml_types import dequantize, dequantize_rows


def ggml_dequantize(w: torch.Tensor, qtype: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """All rows of a GGML-typed weight as float32 ``[N, K]``."""
    return dequantize(w, qtype, (w.shape[0], k), out=out)


def ggml_embedding(w: torch.Tensor, qtype: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of a GGML-typed table as float32 ``[*ids.shape, K]``."""
    rows = dequantize_rows(w, qtype, (w.shape[0], k), ids.reshape(-1))
    return rows.view(*ids.shape, k)


def ggml_linear(x: torch.Tensor, w: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """``x @ W.T`` for a GGML-typed weight (reference: decode, then fp32 matmul)."""
    return F.linear(x, ggml_dequantize(w, qtype, k))


def int8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for an int8 per-output-channel weight (reference)."""
    return F.linear(x, w.float() * scale[:, None])


def int4_dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """A group-wise int4 weight as float32 ``[N, K]``."""
    n = packed.shape[0]
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, -1).float()
    q = q.view(n, -1, group)
    return ((q - zeros[:, :, None]) * scales[:, :, None]).reshape(n, -1)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group: int) -> torch.Tensor:
    """``x @ W.T`` for a group-wise int4 weight (reference)."""
    return F.linear(x, int4_dequantize(packed, scales, zeros, group))
