"""What the KV cache is made of: layer groups, each with its spec, and the blocks each group gets.

Layers whose K/V are kept alike form a group (`KVCacheGroup`): full attention, or a sliding
window of a given size (Gemma 3: 15 sliding layers of 512 tokens and 3 full ones make two groups).
Each group has its own block pool and each sequence its own block table per group, so a group can
hold blocks by its own rule: a sliding-window group releases the blocks its window no longer
sees (`KVCacheSpec.first_needed_position`), the full-attention group keeps them all. Every group
gets the same number of blocks (`KVCacheConfig.num_blocks`), so the pool holds as many tokens as
before the split; a smaller share for the sliding groups is the KV-compression work's to choose.

The spec is plain data: the engine sends it to the workers, which allocate each layer's
`LayerKVCache` from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turbollm.attention.kv_storage import KVLayout, LayerKVCache
from turbollm.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """Full attention: a sequence's every block stays needed while it runs."""

    layout: KVLayout

    @property
    def kind(self) -> str:
        return "full_attention"

    def first_needed_position(self, num_computed: int) -> int:
        """The oldest position the next new token (at `num_computed`) can still attend to."""
        return 0

    def tag(self) -> bytes:
        """What the prefix-cache key of this group's blocks is salted with (their content depends on it)."""
        return repr((self.kind, str(self.layout.dtype), self.layout.block_size, self.layout.num_kv_heads,
                     self.layout.head_dim)).encode()


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A sliding window: token p sees positions p - window + 1 .. p only."""

    window: int = 0

    @property
    def kind(self) -> str:
        return f"sliding_window({self.window})"

    def first_needed_position(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1)


@dataclass(frozen=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int  # per group
    block_size: int
    groups: tuple[KVCacheGroup, ...]
    model_salt: bytes = b""  # the model's identity, in every prefix-cache key

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.groups)

    @property
    def dtype(self) -> torch.dtype:
        return self.groups[0].spec.layout.dtype

    @property
    def layer_groups(self) -> list[int]:
        """Per layer, the index of its group."""
        out = [0] * self.num_layers
        for gi, g in enumerate(self.groups):
            for layer in g.layer_ids:
                out[layer] = gi
        return out

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return sum(len(g.layer_ids) * g.spec.layout.bytes_per_token for g in self.groups)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    def salt(self, group: int) -> bytes:
        return self.model_salt + b"|" + self.groups[group].spec.tag()

    def describe(self) -> str:
        return ", ".join(f"{g.spec.kind} × {len(g.layer_ids)} layers" for g in self.groups)

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                  model_salt: bytes = b"") -> "KVCacheConfig":
        """The model's layers grouped by attention kind (full, or each sliding-window size)."""
        layout = KVLayout(dtype, block_size, cfg.num_kv_heads, cfg.head_dim)
        by_window: dict[int | None, list[int]] = {}
        for i in range(cfg.num_layers):
            by_window.setdefault(cfg.layer_window(i), []).append(i)
        groups = tuple(KVCacheGroup(KVCacheSpec(layout) if w is None else SlidingWindowSpec(layout, w), tuple(ids))
                       for w, ids in sorted(by_window.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)))
        return cls(max(1, int(num_blocks)), block_size, groups, model_salt)

    @classmethod
    def from_budget(cls, cfg: ModelConfig, memory_bytes: int, block_size: int, dtype: torch.dtype = torch.float32,
                    model_salt: bytes = b"") -> "KVCacheConfig":
        probe = cls.for_model(cfg, 1, block_size, dtype, model_salt)
        return cls.for_model(cfg, memory_bytes // (probe.bytes_per_token * block_size), block_size, dtype, model_salt)


def default_kv_budget(cfg: ModelConfig, dtype: torch.dtype, block_size: int, max_model_len: int,
                      max_num_seqs: int) -> int:
    """Bytes for `max_num_seqs` sequences of `max_model_len` tokens each (whole blocks): the most a
    default-sized cache can ever use, so a small model with a short context is not given gigabytes."""
    per_seq = -(-max_model_len // block_size) * block_size
    return KVCacheConfig.for_model(cfg, 1, block_size, dtype).bytes_per_token * per_seq * max_num_seqs


def allocate_kv_storage(config: KVCacheConfig) -> list[LayerKVCache]:
    """Each layer's zeroed K/V storage, `config.num_blocks` blocks of its group's layout."""
    out: list[LayerKVCache | None] = [None] * config.num_layers
    for g in config.groups:
        for layer in g.layer_ids:
            out[layer] = LayerKVCache.allocate(g.spec.layout, config.num_blocks)
    return out
