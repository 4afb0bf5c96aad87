"""Each layer's K/V storage, allocated by a worker from the `KVCacheConfig` the engine sent."""

from __future__ import annotations

from turbollm.attention.kv_storage import LayerKVCache
from turbollm.handoff.kv_cache_spec import KVCacheConfig


def allocate_kv_storage(config: KVCacheConfig, layers: range | None = None) -> list[LayerKVCache | None]:
    """Each layer's zeroed K/V storage, its group's blocks of its group's layout; with `layers` (a
    pipeline stage's), those layers' only (None for the others)."""
    out: list[LayerKVCache | None] = [None] * config.num_layers
    for gi, g in enumerate(config.groups):
        for layer in g.layer_ids:
            if layers is None or layer in layers:
                out[layer] = LayerKVCache.allocate(g.spec.layout, config.blocks_of(gi))
    return out
