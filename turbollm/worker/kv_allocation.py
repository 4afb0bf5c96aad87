"""Each layer's K/V storage, allocated by a worker from the `KVCacheConfig` the engine sent."""

from __future__ import annotations

from turbollm.attention.kv_storage import LayerKVCache
from turbollm.handoff.kv_cache_spec import KVCacheConfig
from turbollm.kv_transfer.shared_pool import SharedArena, tensor_bytes


def allocate_kv_storage(config: KVCacheConfig, layers: range | None = None,
                        arena: SharedArena | None = None) -> list[LayerKVCache | None]:
    """Each layer's zeroed K/V storage, its group's blocks of its group's layout; with `layers` (a
    pipeline stage's), those layers' only (None for the others); from `arena` when given."""
    out: list[LayerKVCache | None] = [None] * config.num_layers
    for layer, layout, n in _layers(config, layers):
        out[layer] = LayerKVCache.allocate(layout, n, arena.tensor if arena is not None else None)
    return out


def allocate_shared_kv_storage(config: KVCacheConfig,
                               layers: range | None = None) -> tuple[list[LayerKVCache | None], SharedArena]:
    """`allocate_kv_storage` in one shared-memory file, returned beside the layers: a prefill instance's pool,
    which decode instances on this host copy blocks straight out of (kv_transfer/shared_pool.py)."""
    arena = SharedArena([tensor_bytes(shape, dtype) for _, layout, n in _layers(config, layers)
                         for shape, dtype in layout.format.storage_shapes(n, *layout.block_shape).values()])
    return allocate_kv_storage(config, layers, arena), arena


def _layers(config: KVCacheConfig, layers: range | None):
    return [(layer, g.spec.layout, config.blocks_of(gi)) for gi, g in enumerate(config.groups)
            for layer in g.layer_ids if layers is None or layer in layers]
