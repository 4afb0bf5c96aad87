"""The attention layer of a decoder block: store K/V in the paged cache, attend, return [T, Hq*D]."""

from __future__ import annotations

import torch
from torch import nn

from turbollm.attention import AttentionMetadata, AttentionBackend
from turbollm.attention.kv_storage import LayerKVCache


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.window, self.softcap = scale, window, softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache,
                meta: AttentionMetadata, backend: AttentionBackend, q_sink: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] for the new tokens; kv_cache: this layer's paged storage; q_sink:
        the queries rotated to their sink position (`sink_positions`) when the group keeps attention sinks."""
        window = self.window if meta.window is None else meta.window
        if kv_cache.layout.quant is not None:  # int8 / int4 blocks and a float16 ring of recent tokens
            backend.write_kv_quant(k, v, kv_cache, meta)
            return backend.forward_quant(q, kv_cache, meta, self.scale, window, self.softcap)
        k_cache, v_cache = kv_cache.k, kv_cache.v
        backend.write_kv(k, v, k_cache, v_cache, meta)
        if meta.sinks:
            return backend.forward(q, k_cache, v_cache, meta, self.scale, window, self.softcap,
                                   sinks=meta.sinks, q_sink=q_sink)
        out = backend.forward(q, k_cache, v_cache, meta, self.scale, window, self.softcap)
        if meta.key_mass is not None:  # an eviction policy's scores: this layer's attention per cached block
            backend.key_mass(q, k_cache, meta, self.scale, self.softcap)
        return out


def sink_positions(positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The position each query takes when it scores the sinks: min(p, sinks + window - 1) (StreamingLLM's
    positions within the cache: the sinks first, then the window, the query last)."""
    return positions.clamp(max=meta.sinks + meta.window - 1)
