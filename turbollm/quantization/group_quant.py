"""Group-wise integer quantization of a weight matrix: the grid, round-to-nearest, the result.

A weight ``W [N, K]`` (N output rows, K input columns) is cut along K into groups of g
columns; each (row, group) gets a scale s and an integer zero point z, and each weight a code
``q = clamp(round(w / s) + z, 0, 2^b - 1)``, so that ``W ≈ (q - z) * s``.

`QuantGrid` is that grid (bits, symmetric or not, the smallest allowed zero point). The
asymmetric range always contains 0 (as in the GPTQ paper's quantizer): a group of one sign
then keeps all its values representable instead of being clipped. Scales are rounded to
float16 when they are made, because the GPTQ/AWQ checkpoint layouts store them so; keeping
exactly what the file will hold makes export → load exact. GPTQ's v1 layout stores ``z - 1``
in unsigned nibbles, so a zero point of 0 cannot be written: GPTQ asks for ``zero_min=1``
(a group whose zero would be 0 gets ``s = max / (2^b - 2)``, z = 1; its range still covers it).

`QuantizedWeight` is the result every quantizer returns (RTN, GPTQ, AWQ) and every exporter
and runtime layout reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIN_SCALE = 2.0 ** -20  # a float16 subnormal; scales of all-zero groups


def fp16_round(t: torch.Tensor) -> torch.Tensor:
    """Round float32 scales to the nearest float16 value (kept as float32), never to 0."""
    return t.clamp(min=_MIN_SCALE).half().float().clamp(min=_MIN_SCALE)


@dataclass(frozen=True)
class QuantGrid:
    """The integer grid: `bits` per code; symmetric (z = 2^(b-1)) or min/max asymmetric."""

    bits: int
    symmetric: bool = False
    zero_min: int = 0

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def params(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero of each row of `w` [..., g] (the last axis is one group)."""
        w = w.float()
        if self.symmetric:
            half = 1 << (self.bits - 1)
            scale = fp16_round(w.abs().amax(-1) / (half - 1))
            return scale, torch.full_like(scale, float(half))
        xmin = w.amin(-1).clamp(max=0.0)
        xmax = w.amax(-1).clamp(min=0.0)
        scale = fp16_round((xmax - xmin) / self.maxq)
        zero = torch.round(-xmin / scale)
        if self.zero_min:
            low = zero < self.zero_min
            if bool(low.any()):
                scale = torch.where(low, fp16_round(xmax / (self.maxq - self.zero_min)), scale)
                zero = torch.round(-xmin / scale)
        return scale, zero.clamp(self.zero_min, self.maxq)

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Codes of `w` for broadcastable `scale`/`zero` (float tensor of integer values)."""
        return torch.clamp(torch.round(w / scale) + zero, 0, self.maxq)

    def fake_quantize(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return (self.quantize(w, scale, zero) - zero) * scale


@dataclass
class QuantizedWeight:
    """Codes with their group scales and zero points.

    Storage order may differ from the input-column order (GPTQ act-order): storage column j
    is input column ``perm[j]``; groups are g consecutive *storage* columns. Then
    ``W[:, perm][n, j] = (q[n, j] - zeros[n, j // g]) * scales[n, j // g]``.
    """

    q: torch.Tensor  # uint8 [N, K], codes in storage order
    scales: torch.Tensor  # float32 [N, K // g] (float16-representable)
    zeros: torch.Tensor  # float32 [N, K // g] (integers)
    bits: int
    group_size: int  # g; K for one group per row
    perm: torch.Tensor | None = None  # int64 [K], None = identity
    symmetric: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize_storage(self) -> torch.Tensor:
        """float32 ``[N, K]`` in storage column order."""
        n, k = self.q.shape
        g = self.group_size
        q = self.q.float().view(n, k // g, g)
        return ((q - self.zeros[..., None]) * self.scales[..., None]).reshape(n, k)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]`` in input column order (what the layer multiplies by)."""
        w = self.dequantize_storage()
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def group_index(self) -> torch.Tensor:
        """int32 ``[K]``: the group of each *input* column (GPTQ's ``g_idx``)."""
        k = self.q.shape[1]
        storage_groups = torch.arange(k, dtype=torch.int32) // self.group_size
        if self.perm is None:
            return storage_groups
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[self.perm] = storage_groups
        return g_idx

    def rows(self, start: int, stop: int) -> "QuantizedWeight":
        """Output rows ``[start, stop)`` (a shard of a fused Q/K/V or gate/up weight)."""
        return QuantizedWeight(self.q[start:stop], self.scales[start:stop], self.zeros[start:stop], self.bits,
                               self.group_size, self.perm, self.symmetric)


def rtn_quantize(w: torch.Tensor, grid: QuantGrid, group_size: int) -> QuantizedWeight:
    """Round-to-nearest: each group's scale/zero from its min/max, each weight rounded alone."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the {k} input columns")
    wg = w.float().reshape(n, k // group_size, group_size)
    scale, zero = grid.params(wg)
    q = grid.quantize(wg, scale[..., None], zero[..., None])
    return QuantizedWeight(q.reshape(n, k).to(torch.uint8), scale, zero, grid.bits, group_size,
                           symmetric=grid.symmetric)


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 ``[N, K]``, float32 scale ``[N]``), W ≈ q * scale."""
    scale = (w.float().abs().amax(1) / 127.0).clamp(min=1e-12)
    q = torch.clamp(torch.round(w.float() / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale
