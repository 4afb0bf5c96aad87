"""FP4 (E2M1) microscaling types: MXFP4 (OCP MX, e8m0 scale) and NVFP4 (ue4m3 scales).

Both store 4-bit E2M1 codes that map through ggml's doubled table ``kvalues_mxfp4``
(0, 1, 2, 3, 4, 6, 8, 12 and their negatives); the scales carry the matching factor 1/2.
"""

from __future__ import annotations

from functools import cache

import torch
from gguf import GGMLQuantizationType as T

from ._base import BlockType, lookup, nibbles, split

#: ggml's ``kvalues_mxfp4``: E2M1 values times two.
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@cache
def _e2m1() -> torch.Tensor:
    return torch.tensor(E2M1_DOUBLED, dtype=torch.float32)


def _ue4m3_half(code: int) -> float:
    """Unsigned E4M3 (bias 7) times 1/2; codes 0x00 and 0x7F read as 0 (as ggml does).

    Bit 7 is ignored, so 0x80..0xFF repeat 0x00..0x7F except that 0x80 and 0xFF are not
    special. Every value is exact in float32.
    """
    if code in (0x00, 0x7F):
        return 0.0
    exp, man = (code >> 3) & 0x0F, code & 0x07
    value = man * 2.0**-9 if exp == 0 else (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    return value * 0.5


@cache
def _ue4m3_table() -> torch.Tensor:
    return torch.tensor([_ue4m3_half(c) for c in range(256)], dtype=torch.float32)


class MXFP4(BlockType, qtype=T.MXFP4):
    """17 bytes / 32 weights: ``e`` e8m0 exponent (1) | 32 x 4-bit codes (16, low nibbles first).

    ``d = 2**(e - 128)`` built from bits (subnormal for ``e < 2``); ``w = d * kvalues[code]``.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        e, qs = split(blocks, 1, 16)
        e = e.to(torch.int32)
        bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
        d = bits.view(torch.float32)
        return lookup(_e2m1(), nibbles(qs, dim=1).reshape(n, 32)).mul_(d)


class NVFP4(BlockType, qtype=T.NVFP4):
    """36 bytes / 64 weights: 4 ue4m3 scales (4) | 4 x 16 codes (32).

    Sub-block ``k`` of 16 uses scale ``k`` and bytes ``8k..8k+7`` (low nibbles, then high
    nibbles); ``w = d_k * kvalues[code]`` with ``d_k`` the ue4m3 value halved.
    """

    @classmethod
    def decode(cls, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        scales, qs = split(blocks, 4, 32)
        d = lookup(_ue4m3_table(), scales)  # (n, 4)
        codes = nibbles(qs.reshape(n, 4, 8), dim=2).reshape(n, 4, 16)
        return lookup(_e2m1(), codes).mul_(d[:, :, None]).reshape(n, 64)
