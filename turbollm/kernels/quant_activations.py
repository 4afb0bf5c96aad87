"""The activation format of the quantized matmuls' integer paths (q8, q8x2, q16), and its reference.

`kernels.quant` runs the products; this module says what the C++ kernels do to the activations
before they meet the weight blocks, bit-exactly (`quantize_activations_ref`), and what product
that amounts to (`q8_linear_ref`), so tests can hold the kernels to it. The block size a weight
type's activations are quantized in comes from the kernels (`kernels.quant.activation_block`).
"""

from __future__ import annotations

import torch


def quantize_activations_ref(x: torch.Tensor, block: int = 32, levels: int = 1) -> tuple[torch.Tensor, ...]:
    """The q8 path's activation quantization, bit-exact with the C++ one.

    ``x`` float32 ``[M, K]`` (K a multiple of ``block``) -> ``q`` int8 ``[R, K]`` and ``d``
    ``[R, K/block]`` (d = amax / 127 per block, q = round-half-even(x * (1 / d))), then for
    block 32: ``s32`` ``[R, K/32]`` = d * sum(q) per block and ``s16`` ``[R, K/16]`` = d * sum(q)
    per half block; for block 256 (the k-quants): ``bs16`` int16 ``[R, K/16]``, the integer
    sums of each 16 q. R = M, or 2M with ``levels=2``: rows 2m quantize x and rows 2m + 1 the
    residual x - d q of each block, so that x ~ d1 q1 + d2 q2 (the "q8x2" path).
    ``levels=16`` (the "q16" path): ``q`` int16 with d = amax / 32767 per block, then d, and s32 / s16
    = d * sum(q) of each 32 / 16 values whatever the block (32, or 256 for the k-quants).
    """
    m, k = x.shape
    x = x.float()
    if levels == 16:
        q, d = _quantize_blocks(x, block, 32767.0)
        half = q.view(m, k // 16, 16).sum(dim=-1).view(m, k // 32, 2)
        d32 = d.repeat_interleave(block // 32, dim=1)  # each 32 values' block scale
        return (q.to(torch.int16), d, d32 * half.sum(dim=-1).float(), (d32[..., None] * half.float()).reshape(m, k // 16))
    q, d = _quantize_blocks(x, block)
    if levels == 2:
        xq = (q.view(m, k // block, block).float() * d[..., None]).reshape(m, k)
        q2, d2 = _quantize_blocks(x - xq, block)
        q = torch.stack((q, q2), dim=1).reshape(2 * m, k)
        d = torch.stack((d, d2), dim=1).reshape(2 * m, k // block)
        m = 2 * m
    sums16 = q.view(m, k // 16, 16).sum(dim=-1)
    q8 = q.to(torch.int8)
    if block == 256:
        return q8, d, sums16.to(torch.int16)
    half = sums16.view(m, k // 32, 2)
    s16 = d[..., None] * half.float()
    s32 = d * half.sum(dim=-1).float()
    return q8, d, s32, s16.reshape(m, k // 16)


def _quantize_blocks(x: torch.Tensor, block: int, qmax: float = 127.0) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``q`` ``[M, K]`` and ``d`` ``[M, K/block]`` of float32 ``x`` (see quantize_activations_ref)."""
    m, k = x.shape
    xb = x.reshape(m, k // block, block)
    d = xb.abs().amax(dim=-1) / qmax
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(xb * inv[..., None]).to(torch.int32).reshape(m, k), d


def q8_linear_ref(x: torch.Tensor, w_dequantized: torch.Tensor, block: int = 32, levels: int = 1) -> torch.Tensor:
    """What the q8 (levels=1), q8x2 (levels=2) or q16 (levels=16) path computes, up to summation order:
    (dequantized x) @ W.T in float64, x quantized in blocks of ``block`` (``activation_block``)."""
    q, d = quantize_activations_ref(x, block, levels)[:2]
    r, k = q.shape
    xq = (q.view(r, k // block, block).double() * d.double()[..., None]).reshape(r, k)
    if levels == 2:
        xq = xq.view(r // 2, 2, k).sum(dim=1)
    return (xq @ w_dequantized.double().T).float()
