"""Ternary types TQ1_0 and TQ2_0: 256 weights in {-1, 0, +1} times one fp16 scale.

TQ2_0 stores each trit in 2 bits; TQ1_0 packs five trits per byte in base 3 (scaled so the
first trit is the top of the byte) and four trits in each of the last 4 ``qh`` bytes.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from ._base import BlockType, f16, split, unpack

_POW3 = (1, 3, 9, 27, 81)


def _trits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Trits of uint8 ``(n, m)`` bytes -> uint8 ``(n, count * m)``: trit ``k`` of every byte,
    then trit ``k + 1`` of every byte... Trit ``k`` is the top base-3 digit of ``byte * 3**k``
    (mod 256), read as ``(that * 3) >> 8``."""
    n = packed.shape[0]
    pow3 = torch.tensor(_POW3[:count], dtype=torch.uint8).reshape(1, count, 1)
    shifted = (packed[:, None, :] * pow3).to(torch.int16)  # uint8 product wraps mod 256
    return ((shifted * 3) >> 8).reshape(n, -1)


class TQ1_0(BlockType, qtype=T.TQ1_0):
    """54 bytes / 256 weights: ``qs`` (48: 32 bytes x 5 trits, 16 bytes x 5 trits) |
    ``qh`` (4 bytes x 4 trits) | ``d`` fp16; ``w = d * (trit - 1)``."""

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        qs, qh, d = split(blocks, 48, 4, 2)
        t = torch.cat((_trits(qs[:, :32], 5), _trits(qs[:, 32:], 5), _trits(qh, 4)), dim=1)
        return (t - 1).to(torch.float32).mul_(f16(d))


class TQ2_0(BlockType, qtype=T.TQ2_0):
    """66 bytes / 256 weights: ``qs`` 2-bit (64: two runs of 32 bytes x 4 planes) | ``d`` fp16;
    ``w = d * (q - 1)``."""

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        qs, d = split(blocks, 64, 2)
        q = unpack(qs.reshape(n, 2, 32), 2, dim=2).reshape(n, 256).to(torch.int8) - 1
        return q.to(torch.float32).mul_(f16(d))
