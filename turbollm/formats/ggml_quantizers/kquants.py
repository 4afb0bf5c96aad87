"""Encoders of the k-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256-weight super-blocks).

Each follows llama.cpp's ``quantize_row_q*_K_ref`` (``ggml-quants.c``), the routine
``llama-quantize`` runs when no importance matrix is given:

1. every sub-block (16 or 32 weights) gets its own float scale (and offset) from a search in
   ``search.py``: ``make_qkx2_quants`` for Q2_K / Q4_K / Q5_K (scale and min; weights ``|x|``
   for Q2_K, ``rms(sub-block) + |x|`` for Q4_K / Q5_K), ``make_q3_quants`` for Q3_K,
   ``make_qx_quants`` for Q6_K;
2. those scales are themselves quantized to 4 / 6 / 8 bits against the super-block's largest
   one, which becomes the fp16 ``d`` (and ``dmin``);
3. every weight is re-quantized with the sub-block scale as actually stored
   (``d * sc``, ``dmin * m``), so the quants fit the decoded scales; a sub-block whose stored
   scale is zero keeps the quants of step 1;
4. the quants are packed in ggml's bit-plane layout (see ``turbollm.formats.ggml_types.kquants``).

Blocks arrive as float32 ``(n_blocks, 256)``; sub-blocks are handled as the columns of an
``(n, n_blocks * n_sub)`` tensor so that every step is one vectorized operation.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from ._base import (
    BlockQuantizer,
    as_i8,
    as_u8,
    first_absmax,
    fp16_bytes,
    fp16_round,
    nearest_int,
    nearest_int_,
    pack_bits,
    rdiv,
    seq_sum,
    sqrt_f32,
)
from .search import GROUP_MAX_EPS, make_q3_quants, make_qkx2_quants, make_qx_quants

QK_K = 256


def _columns(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """``(B, 256)`` -> ``(n, B * 256 // n)``: one sub-block of ``n`` weights per column."""
    return blocks.reshape(-1, n).T.contiguous()


def _rows(cols: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """Inverse of :func:`_columns` for per-weight tensors: ``(n, G)`` -> ``(B, 256)``."""
    return cols.T.reshape(n_blocks, QK_K)


def _positive_max(v: torch.Tensor) -> torch.Tensor:
    """``max(0, max_j v[:, j])`` as the C loops ``if (v > m) m = v`` starting at ``m = 0``."""
    m = v.amax(dim=1)
    return torch.where(m > 0, m, torch.zeros_like(m))


def _pack_2bit(L: torch.Tensor) -> torch.Tensor:
    """Q2_K / Q3_K ``qs``: per 128 weights, 32 bytes holding elements ``l, l+32, l+64, l+96``."""
    return pack_bits(L.reshape(-1, 2, 4, 32), 2).reshape(-1, 64)


def _requantize(x: torch.Tensor, d: torch.Tensor, offset: torch.Tensor | None, lo: int, hi: int,
                L: torch.Tensor) -> torch.Tensor:
    """Step 3: ``clamp(nearest_int((x + offset) / d))`` per sub-block, keeping ``L`` where ``d == 0``.

    ``x`` is ``(B, S, n)``, ``d`` / ``offset`` ``(B, S)``, ``L`` ``(B, S, n)``.
    """
    num = x / d[..., None] if offset is None else (x + offset[..., None]).div_(d[..., None])
    new = nearest_int_(num).clamp_(lo, hi)
    return torch.where((d != 0)[..., None], new, L)


def _k4_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Pack 8 six-bit scales and mins ``(B, 8)`` into the 12 scale bytes of Q4_K / Q5_K."""
    lo_s, hi_s, lo_m, hi_m = ls[:, :4], ls[:, 4:], lm[:, :4], lm[:, 4:]
    return torch.cat((lo_s | ((hi_s >> 4) << 6), lo_m | ((hi_m >> 4) << 6),
                      (hi_s & 0x0F) | ((hi_m & 0x0F) << 4)), dim=1).to(torch.uint8)


def _qkx_k4(blocks: torch.Tensor, nmax: int, rmin: float, nstep: int):
    """Steps 1-3 of Q4_K (``nmax`` 15) and Q5_K (31): ``(d, dmin, scale bytes, L (B, 8, 32))``."""
    B = blocks.shape[0]
    xs = _columns(blocks, 32)
    av_x = sqrt_f32(seq_sum(xs * xs) / 32)
    weights = av_x[None, :] + xs.abs()
    scales, mins, L = make_qkx2_quants(xs, weights, nmax, rmin, 0.1, nstep, use_mad=False)
    scales, mins = scales.reshape(B, 8), mins.reshape(B, 8)
    L = _rows(L, B).reshape(B, 8, 32)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    inv_scale = torch.where(max_scale > 0, rdiv(63.0, max_scale), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, rdiv(63.0, max_min), torch.zeros_like(max_min))
    ls = as_u8(nearest_int(inv_scale[:, None] * scales)).to(torch.int32).clamp_(max=63)
    lm = as_u8(nearest_int(inv_min[:, None] * mins)).to(torch.int32).clamp_(max=63)
    d, dmin = max_scale / 63, max_min / 63
    dl = fp16_round(d)[:, None] * ls.to(torch.float32)
    ml = fp16_round(dmin)[:, None] * lm.to(torch.float32)
    L = _requantize(blocks.reshape(B, 8, 32), dl, ml, 0, nmax, L)
    return d, dmin, _k4_scales(ls, lm), L


class Q4_K(BlockQuantizer, qtype=T.Q4_K):
    """``quantize_row_q4_K_ref``: 8 x 32 weights, ``make_qkx2_quants(nmax 15, rmin -1, 20 steps)``.

    144 bytes: ``d`` | ``dmin`` fp16 | 12 scale bytes | 128 nibble bytes.
    """

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        d, dmin, sc, L = _qkx_k4(blocks, 15, -1.0, 20)
        q = L.reshape(-1, 4, 2, 32)
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).to(torch.uint8).reshape(-1, 128)
        return torch.cat((fp16_bytes(d), fp16_bytes(dmin), sc, qs), dim=1)


class Q5_K(BlockQuantizer, qtype=T.Q5_K):
    """``quantize_row_q5_K_ref``: 8 x 32 weights, ``make_qkx2_quants(nmax 31, rmin -0.5, 15 steps)``.

    176 bytes: ``d`` | ``dmin`` fp16 | 12 scale bytes | ``qh`` (bit 4; bit ``k`` for sub-block
    ``k``) | 128 nibble bytes.
    """

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        d, dmin, sc, L = _qkx_k4(blocks, 31, -0.5, 15)
        qh = pack_bits(L >> 4, 1)
        q = (L & 0x0F).reshape(-1, 4, 2, 32)
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).to(torch.uint8).reshape(-1, 128)
        return torch.cat((fp16_bytes(d), fp16_bytes(dmin), sc, qh, qs), dim=1)


class Q2_K(BlockQuantizer, qtype=T.Q2_K):
    """``quantize_row_q2_K_ref``: 16 x 16 weights, ``make_qkx2_quants(nmax 3, weights |x|, 15 steps, MAD)``.

    84 bytes: 16 scale bytes (``min << 4 | scale``) | 64 bytes of 2-bit quants | ``d`` | ``dmin``.
    """

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        B = blocks.shape[0]
        xs = _columns(blocks, 16)
        scales, mins, L = make_qkx2_quants(xs, xs.abs(), 3, -0.5, 0.1, 15, use_mad=True)
        scales, mins = scales.reshape(B, 16), mins.reshape(B, 16)
        L = _rows(L, B).reshape(B, 16, 16)
        max_scale, max_min = _positive_max(scales), _positive_max(mins)
        zero = torch.zeros_like(max_scale)
        has_s, has_m = (max_scale > 0)[:, None], (max_min > 0)[:, None]
        ls = torch.where(has_s, nearest_int(rdiv(15.0, max_scale)[:, None] * scales), 0)
        lm = torch.where(has_m, nearest_int(rdiv(15.0, max_min)[:, None] * mins), 0)
        sc = as_u8(ls).to(torch.int32) | ((lm << 4) & 0xFF)
        d = torch.where(max_scale > 0, max_scale / 15, zero)
        dmin = torch.where(max_min > 0, max_min / 15, zero)
        dl = fp16_round(d)[:, None] * (sc & 0x0F).to(torch.float32)
        ml = fp16_round(dmin)[:, None] * (sc >> 4).to(torch.float32)
        L = _requantize(blocks.reshape(B, 16, 16), dl, ml, 0, 3, L)
        return torch.cat((sc.to(torch.uint8), _pack_2bit(L), fp16_bytes(d), fp16_bytes(dmin)), dim=1)


class Q3_K(BlockQuantizer, qtype=T.Q3_K):
    """``quantize_row_q3_K_ref``: 16 x 16 weights, ``make_q3_quants(nmax 4, rmse)``; 6-bit scales.

    110 bytes: ``hmask`` (bit 2 of each quant) | 64 bytes of low 2 bits | 12 scale bytes | ``d``.
    """

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        B = blocks.shape[0]
        scales, L = make_q3_quants(_columns(blocks, 16), 4)
        scales = scales.reshape(B, 16)
        L = _rows(L, B).reshape(B, 16, 16)
        _, max_scale = first_absmax(scales, 1)
        nz = max_scale != 0
        iscale = rdiv(-32.0, max_scale)
        l = as_i8(nearest_int(iscale[:, None] * scales)).clamp_(-32, 31) + 32
        l = torch.where(nz[:, None], l, 0)
        d = torch.where(nz, rdiv(1.0, iscale), torch.zeros_like(iscale))
        dl = fp16_round(d)[:, None] * (l - 32).to(torch.float32)
        L = _requantize(blocks.reshape(B, 16, 16), dl, None, -4, 3, L - 4) + 4
        sc = torch.cat(((l[:, :8] & 0x0F) | ((l[:, 8:] & 0x0F) << 4),
                        pack_bits((l >> 4).reshape(B, 4, 4), 2)), dim=1).to(torch.uint8)
        hmask = pack_bits((L >> 2).reshape(B, 8, 32), 1)
        return torch.cat((hmask, _pack_2bit(L & 3), sc, fp16_bytes(d)), dim=1)


class Q6_K(BlockQuantizer, qtype=T.Q6_K):
    """``quantize_row_q6_K_ref``: 16 x 16 weights, ``make_qx_quants(nmax 32, rmse_type 1)``; int8 scales.

    210 bytes: 128 bytes of low nibbles | 64 bytes of high 2 bits | 16 int8 scales | ``d``.
    """

    @classmethod
    def quantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        B = blocks.shape[0]
        scales, L = make_qx_quants(_columns(blocks, 16), 32)
        scales = scales.reshape(B, 16)
        L = _rows(L, B).reshape(B, 16, 16)
        max_abs, max_scale = first_absmax(scales, 1)
        zero = max_abs < GROUP_MAX_EPS
        iscale = rdiv(-128.0, max_scale)
        sc = as_i8(nearest_int(iscale[:, None] * scales).clamp_(max=127))
        d = rdiv(1.0, iscale)
        dl = fp16_round(d)[:, None] * sc.to(torch.float32)
        L = _requantize(blocks.reshape(B, 16, 16), dl, None, -32, 31, L - 32) + 32
        q = L.reshape(B, 2, 4, 32)
        ql = torch.cat(((q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4),
                        (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)), dim=2).reshape(B, 128)
        qh = pack_bits(q >> 4, 2).reshape(B, 64)
        out = torch.cat((ql.to(torch.uint8), qh, as_u8(sc), fp16_bytes(d)), dim=1)
        out[zero] = 0
        return out
