"""KV policies: which K/V a layer group keeps, one registry entry each (`--kv-policy`).

A policy builds the spec of each layer group (`engine/kv_cache_spec.py`) from the group's storage
layout and attention window; the spec's rule (`first_needed_position`, `max_blocks`) is what the
KV-cache manager and the pool sizing follow, so a policy never threads a flag through the core.

- "auto" (default): a sliding-window layer releases the blocks its window has passed, so Gemma 3's
  15 local layers hold about 512 tokens each at any context; full-attention layers keep everything.
- "dense": every layer keeps every block (the sliding layers still attend to their window only):
  the baseline that "auto" is measured against (same outputs, more memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from turbollm.attention.kv_storage import KVLayout
from turbollm.engine.kv_cache_spec import KVCacheSpec, SlidingWindowSpec
from turbollm.errors import InvalidRequestError


@dataclass(frozen=True)
class KVPolicy:
    name: str
    help: str
    spec: Callable[[KVLayout, int | None], KVCacheSpec]  # (layout, window or None) -> the group's spec


KV_POLICIES: dict[str, KVPolicy] = {}


def register_kv_policy(policy: KVPolicy) -> KVPolicy:
    KV_POLICIES[policy.name] = policy
    return policy


def get_kv_policy(name: str) -> KVPolicy:
    if name not in KV_POLICIES:
        raise InvalidRequestError(f"kv_policy {name!r}: choose one of {', '.join(KV_POLICIES)}")
    return KV_POLICIES[name]


register_kv_policy(KVPolicy(
    "auto", "sliding-window layers release the blocks their window has passed; other layers keep every block",
    lambda layout, window: KVCacheSpec(layout) if window is None else SlidingWindowSpec(layout, window)))
register_kv_policy(KVPolicy(
    "dense", "every layer keeps every block (sliding-window layers still attend to their window only)",
    lambda layout, window: KVCacheSpec(layout) if window is None else SlidingWindowSpec(layout, window,
                                                                                         release_blocks=False)))
