"""K/V storage formats as registered classes: what a block of each format holds, its bytes, and (for the
quantized ones) the PyTorch reference of its quantization.

A format is looked up by its storage dtype (`kv_format`), which `KVLayout.format` does for every layer; the
layout's other properties (`quant`, `quant_bits`, `block_bytes`, `ring_factor`) read the format, and the kernels
and the fused step receive its description as numbers (bits, ring blocks), never a name to branch on.

- `Float32KV`, `Float16KV`: K and V `[blocks, block_size, heads, head_dim]` in that dtype.
- `Int8KV`: int8 symmetric (scale = max|x| / 127); K scaled per channel over the block's tokens (KIVI: K has
  outlier channels), V per token; float16 scales `k_scale [N, H, D]`, `v_scale [N, bs, H]`.
- `Int4KV`: int4 asymmetric (scale = (max - min) / 15, the minimum kept), values 0..15 packed two a byte
  along head_dim (even channel in the low nibble); `k_scale [N, 2, H, D]` and `v_scale [N, bs, H, 2]` hold
  scale then minimum.
Scales are rounded to float16 before they divide, so the stored scale is the one that was used. A quantized
format keeps each running sequence's newest tokens in float16 in a ring of pool blocks (attention/kv_storage.py).
"""

from __future__ import annotations

import torch


class KVFormat:
    #: kv_cache_dtype name, storage element type, bits per stored value (0: a float format)
    name: str = ""
    dtype: torch.dtype = torch.float32
    bits: int = 0

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    def block_bytes(self, bs: int, H: int, D: int) -> int:
        """K and V of one block in one layer, scales included."""
        return 2 * bs * H * D * torch.tensor([], dtype=self.dtype).element_size()

    def storage_shapes(self, num_blocks: int, bs: int, H: int, D: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each tensor of a layer's storage: name -> (shape, dtype)."""
        shape = (num_blocks, bs, H, D)
        return {"k": (shape, self.dtype), "v": (shape, self.dtype)}


class QuantizedKVFormat(KVFormat):
    @property
    def ring_factor(self) -> int:
        """Pool blocks whose K (or V) bytes hold one float16 block of the ring of recent tokens."""
        return 16 // self.bits

    def quantize_k(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., bs, H, D] (blocks' keys) -> (values, scales), per channel over the block's tokens."""
        raise NotImplementedError

    def quantize_v(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H, D] -> (values, scales), per token."""
        raise NotImplementedError

    def dequantize_k(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Blocks' keys [n, bs, H, D*] with their scales -> float32 [n, bs, H, D]."""
        raise NotImplementedError

    def dequantize_v(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Blocks' values [n, bs, H, D*] with their scales -> float32 [n, bs, H, D]."""
        raise NotImplementedError


KV_FORMATS: dict[torch.dtype, KVFormat] = {}


def register_kv_format(cls: type[KVFormat]) -> type[KVFormat]:
    KV_FORMATS[cls.dtype] = cls()
    return cls


def kv_format(dtype: torch.dtype) -> KVFormat:
    try:
        return KV_FORMATS[dtype]
    except KeyError:
        raise ValueError(f"no K/V storage format for dtype {dtype} (known: "
                         f"{', '.join(f.name for f in KV_FORMATS.values())})") from None


@register_kv_format
class Float32KV(KVFormat):
    name, dtype = "float32", torch.float32


@register_kv_format
class Float16KV(KVFormat):
    name, dtype = "float16", torch.float16


@register_kv_format
class Int8KV(QuantizedKVFormat):
    name, dtype, bits = "int8", torch.int8, 8

    def block_bytes(self, bs: int, H: int, D: int) -> int:  # int8 values; K: a float16 scale per channel, V: per token
        return 2 * bs * H * D + 2 * H * D + 2 * bs * H

    def storage_shapes(self, num_blocks, bs, H, D):
        shape = (num_blocks, bs, H, D)
        return {"k": (shape, torch.int8), "v": (shape, torch.int8), "k_scale": ((num_blocks, H, D), torch.float16),
                "v_scale": ((num_blocks, bs, H), torch.float16)}

    def quantize_k(self, x):
        x = x.float()
        s = (x.abs().amax(-3) / 127).half().float()
        q = torch.round(x / torch.where(s > 0, s, 1).unsqueeze(-3)).clamp(-127, 127).to(torch.int8)
        return q, s.half()

    def quantize_v(self, x):
        x = x.float()
        s = (x.abs().amax(-1) / 127).half().float()
        q = torch.round(x / torch.where(s > 0, s, 1)[..., None]).clamp(-127, 127).to(torch.int8)
        return q, s.half()

    def dequantize_k(self, q, s):
        return q.float() * s.float()[:, None]

    def dequantize_v(self, q, s):
        return q.float() * s.float()[..., None]


@register_kv_format
class Int4KV(QuantizedKVFormat):
    name, dtype, bits = "int4", torch.uint8, 4

    def block_bytes(self, bs: int, H: int, D: int) -> int:  # two values a byte; K: scale and minimum per channel, V: per token
        return bs * H * D + 4 * H * D + 4 * bs * H

    def storage_shapes(self, num_blocks, bs, H, D):
        if D % 2:
            raise ValueError(f"int4 K/V packs two values a byte: head_dim {D} must be even")
        packed = (num_blocks, bs, H, D // 2)
        return {"k": (packed, torch.uint8), "v": (packed, torch.uint8),
                "k_scale": ((num_blocks, 2, H, D), torch.float16), "v_scale": ((num_blocks, bs, H, 2), torch.float16)}

    def quantize_k(self, x):
        x = x.float()
        mn, mx = x.amin(-3).half().float(), x.amax(-3)
        s = ((mx - mn) / 15).half().float()
        q = torch.round((x - mn.unsqueeze(-3)) / torch.where(s > 0, s, 1).unsqueeze(-3)).clamp(0, 15).to(torch.uint8)
        return _pack(q), torch.stack([s, mn], -3).half()

    def quantize_v(self, x):
        x = x.float()
        mn, mx = x.amin(-1).half().float(), x.amax(-1)
        s = ((mx - mn) / 15).half().float()
        q = torch.round((x - mn[..., None]) / torch.where(s > 0, s, 1)[..., None]).clamp(0, 15).to(torch.uint8)
        return _pack(q), torch.stack([s, mn], -1).half()

    def dequantize_k(self, q, s):
        return _unpack(q).float() * s[:, 0].float()[:, None] + s[:, 1].float()[:, None]

    def dequantize_v(self, q, s):
        return _unpack(q).float() * s[..., 0].float()[..., None] + s[..., 1].float()[..., None]


def _pack(q: torch.Tensor) -> torch.Tensor:
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 15, p >> 4], -1).flatten(-2)
