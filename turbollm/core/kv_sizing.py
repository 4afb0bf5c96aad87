"""How many KV blocks each group gets: the model's layers grouped by attention kind, each group's spec built
by the KV policy (`core/kv_policy.py`), and the most blocks that fit a memory budget.

The scheduler side computes the `KVCacheConfig` (`turbollm.handoff.kv_cache_spec`, plain data) here and sends it to
the workers, which allocate each layer's storage from it (`worker/kv_allocation.py`). A releasing group never holds
more than `KVCacheSpec.max_blocks` blocks (every sequence slot a window's worth, plus the step's new tokens), so its
pool is capped there and the rest of the budget goes to the groups that keep everything.
"""

from __future__ import annotations

import torch

from turbollm.attention.kv_storage import KVLayout
from turbollm.config import ModelConfig
from turbollm.core.kv_policy import KVPolicyConfig, get_kv_policy
from turbollm.errors import InvalidRequestError
from turbollm.handoff.kv_cache_spec import KVCacheConfig, KVCacheGroup


def kv_config_for_model(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                        model_salt: bytes = b"", policy: str | KVPolicyConfig = "auto", max_num_seqs: int | None = None,
                        max_num_batched_tokens: int | None = None, spec_tokens: int = 0,
                        recent_window: int = 0) -> KVCacheConfig:
    """The model's layers grouped by attention kind (full, or each sliding-window size), each group's
    spec as the KV policy builds it. Given `max_num_seqs` and `max_num_batched_tokens`, a group that
    releases blocks gets no more than it can hold at once (`KVCacheSpec.max_blocks`). A quantized
    `dtype` (torch.int8: int8, torch.uint8: int4) keeps `recent_window` tokens per sequence in float16,
    in one ring per sequence slot (`max_num_seqs` of them)."""
    options = policy if isinstance(policy, KVPolicyConfig) else KVPolicyConfig(policy)
    make_spec = get_kv_policy(options.name).spec
    layout = KVLayout(dtype, block_size, cfg.num_kv_heads, cfg.head_dim)
    if layout.quant:
        layout = KVLayout(dtype, block_size, cfg.num_kv_heads, cfg.head_dim, recent_window)
    by_window: dict[int | None, list[int]] = {}
    for i in range(cfg.num_layers):
        by_window.setdefault(cfg.layer_window(i), []).append(i)
    groups = tuple(KVCacheGroup(make_spec(layout, w, options), tuple(ids))
                   for w, ids in sorted(by_window.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)))
    num_blocks = max(1, int(num_blocks))
    caps = _caps(groups, max_num_seqs, max_num_batched_tokens, spec_tokens)
    counts = tuple(num_blocks if c is None else min(c, num_blocks) for c in caps)
    return KVCacheConfig(num_blocks, block_size, groups, model_salt, counts if set(counts) != {num_blocks} else (),
                         (max_num_seqs or 1) if layout.quant else 0)


def kv_config_from_budget(cfg: ModelConfig, memory_bytes: int, block_size: int, dtype: torch.dtype = torch.float32,
                          model_salt: bytes = b"", policy: str | KVPolicyConfig = "auto",
                          max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                          spec_tokens: int = 0, recent_window: int = 0) -> KVCacheConfig:
    """The most blocks for the groups that keep everything such that every group's blocks (and the
    recent rings of a quantized format) fit `memory_bytes` (the capped groups taking their cap first)."""
    def build(n: int) -> KVCacheConfig:
        return kv_config_for_model(cfg, n, block_size, dtype, model_salt, policy, max_num_seqs,
                                   max_num_batched_tokens, spec_tokens, recent_window)

    probe = build(1)
    if probe.total_bytes > memory_bytes:
        raise InvalidRequestError(
            f"the KV-cache budget ({memory_bytes / (1 << 20):.1f} MiB) is smaller than one block per group plus "
            f"the float16 rings of {probe.recent_slots} sequence slots ({probe.ring_bytes / (1 << 20):.2f} MiB each):"
            f" raise kv_cache_memory, or lower max_num_seqs or kv_recent_window")
    # no group can have more blocks than the budget buys of the cheapest one; bytes grow with n
    lo, hi = 1, max(1, memory_bytes // min(probe.block_bytes(g) for g in range(len(probe.groups))))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if build(mid).total_bytes <= memory_bytes else (lo, mid - 1)
    return build(lo)


def _caps(groups: tuple[KVCacheGroup, ...], max_num_seqs: int | None, max_num_batched_tokens: int | None,
          spec_tokens: int) -> list[int | None]:
    if max_num_seqs is None or max_num_batched_tokens is None:
        return [None] * len(groups)
    return [g.spec.max_blocks(max_num_seqs, max_num_batched_tokens, spec_tokens) for g in groups]


def default_kv_budget(cfg: ModelConfig, dtype: torch.dtype, block_size: int, max_model_len: int,
                      max_num_seqs: int, policy: str | KVPolicyConfig = "auto",
                      max_num_batched_tokens: int | None = None, spec_tokens: int = 0, recent_window: int = 0) -> int:
    """Bytes for `max_num_seqs` sequences of `max_model_len` tokens each (whole blocks; a group that
    releases blocks no more than its cap): the most a default-sized cache can ever use, so a small
    model with a short context is not given gigabytes."""
    per_seq = -(-max_model_len // block_size)
    return kv_config_for_model(cfg, per_seq * max_num_seqs, block_size, dtype, b"", policy, max_num_seqs,
                               max_num_batched_tokens, spec_tokens, recent_window).total_bytes
