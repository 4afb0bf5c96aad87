"""What the KV cache is made of: layer groups, each with its spec, and the blocks each group gets.

Layers whose K/V are kept alike form a group (`KVCacheGroup`): full attention, or a sliding
window of a given size (Gemma 3: 15 sliding layers of 512 tokens and 3 full ones make two groups).
Each group has its own block pool and each sequence its own block table per group, so a group can
hold blocks by its own rule: a sliding-window group releases the blocks its window no longer
sees (`KVCacheSpec.first_needed_position`), the full-attention group keeps them all.

A releasing group never holds more than `SlidingWindowSpec.max_blocks` blocks (every sequence slot
a window's worth, plus the step's new tokens), so its pool is capped there and the rest of the
budget goes to the groups that keep everything (`KVCacheConfig.from_budget`): Gemma 3's KV at 4k
context is about a quarter of all-full. The KV policy (`engine/kv_policy.py`) builds each group's
spec: "dense" keeps a sliding group's blocks too (the unreleased baseline).

The spec is plain data: the engine sends it to the workers, which allocate each layer's
`LayerKVCache` from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from turbollm.attention.kv_storage import KVLayout, LayerKVCache
from turbollm.config import ModelConfig

if TYPE_CHECKING:
    from turbollm.engine.kv_policy import KVPolicyConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """Full attention: a sequence's every block stays needed while it runs."""

    layout: KVLayout

    @property
    def kind(self) -> str:
        return "full_attention"

    @property
    def releases_blocks(self) -> bool:
        """Whether a sequence's blocks before `first_needed_position` go back to the pool."""
        return False

    @property
    def bounded(self) -> bool:
        """Whether a sequence holds at most `max_blocks` blocks whatever its length (released or evicted)."""
        return self.releases_blocks

    @property
    def score_rows(self) -> int:
        """How many of a step's last query rows per sequence count toward the attention scores of its
        blocks (0: no scores; an eviction policy's `engine/kv_eviction.py`)."""
        return 0

    def first_needed_position(self, num_computed: int) -> int:
        """The oldest position past the kept prefix (`kept_blocks`) that the next new token (at
        `num_computed`) can still attend to."""
        return 0

    def kept_blocks(self) -> int:
        """Blocks at the start of a sequence that are never released (attention sinks)."""
        return 0

    @property
    def attention(self) -> tuple[int | None, int]:
        """(window, sinks) the group's layers attend with: a policy's window (None: each layer's own) and
        the number of sink positions attended beside it (0: none)."""
        return None, 0

    def tag(self) -> bytes:
        """What the prefix-cache key of this group's blocks is salted with (their content depends on it)."""
        return repr((self.kind, str(self.layout.dtype), self.layout.block_size, self.layout.num_kv_heads,
                     self.layout.head_dim, self.layout.recent_window)).encode()

    def cacheable_tokens(self, num_computed: int) -> int:
        """How many of a sequence's first tokens have their final K/V in the pool (a quantized format's
        recent window is still in the sequence's float16 ring: its blocks enter the prefix cache later)."""
        return max(0, num_computed - self.layout.recent_window) if self.layout.quant else num_computed


    def max_blocks(self, max_num_seqs: int, max_num_batched_tokens: int, spec_tokens: int = 0) -> int | None:
        """The most blocks the group can hold at once (None: no bound below the whole context)."""
        return None


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A sliding window: token p sees positions p - window + 1 .. p only. With `release_blocks`, the
    blocks before the oldest position the next token sees go back to the pool."""

    window: int = 0
    release_blocks: bool = True

    @property
    def kind(self) -> str:
        return f"sliding_window({self.window})" + ("" if self.release_blocks else ", blocks kept")

    @property
    def releases_blocks(self) -> bool:
        return self.release_blocks

    def first_needed_position(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1) if self.release_blocks else 0

    def max_blocks(self, max_num_seqs: int, max_num_batched_tokens: int, spec_tokens: int = 0) -> int | None:
        """A sequence scheduled for n new tokens after c computed ones holds the blocks of positions
        c - window + 1 .. c + n - 1 (the scheduler releases the older ones of every running sequence
        each step): at most ceil((window - 1 + n) / block_size) + 1 blocks, plus one copied on write,
        plus the blocks of up to `spec_tokens` rejected drafts of its last step (kept for its next
        tokens). Summed over the sequence slots, with the n's of a step summing to the token budget."""
        if not self.release_blocks:
            return None
        bs = self.layout.block_size
        per_slot = -(-(self.window - 1) // bs) + 3 + -(-spec_tokens // bs) + self.kept_blocks()
        return max_num_seqs * per_slot + -(-max_num_batched_tokens // bs)


DEFAULT_ATTENTION_SINKS = 4  # StreamingLLM's choice: four initial tokens hold the spare attention


@dataclass(frozen=True)
class SinkWindowSpec(SlidingWindowSpec):
    """Attention sinks + a window (StreamingLLM): token p sees the first `sinks` positions and
    p - window + 1 .. p; the blocks in between go back to the pool, the sinks' blocks never do.

    K is stored after RoPE, at its original position. A window key's distance to the query is the
    same as under StreamingLLM's positions within the cache (sinks 0 .. S-1, window S .. S+W-1, the
    query at S+W-1); a sink's is not, so the attention kernels score the sinks with the query rotated
    to position min(p, S+W-1) (`q_sink`) and the window with the query as it is, in one softmax. The
    largest distance any query meets is S+W-1, whatever the sequence's length."""

    sinks: int = DEFAULT_ATTENTION_SINKS

    @property
    def kind(self) -> str:
        return f"sinks({self.sinks}) + window({self.window})"

    def kept_blocks(self) -> int:
        return -(-self.sinks // self.layout.block_size)

    @property
    def attention(self) -> tuple[int | None, int]:
        return self.window, self.sinks


@dataclass(frozen=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int  # per group that keeps every block (the most any group has)
    block_size: int
    groups: tuple[KVCacheGroup, ...]
    model_salt: bytes = b""  # the model's identity, in every prefix-cache key
    group_blocks: tuple[int, ...] = ()  # blocks of each group (empty: num_blocks each)
    recent_slots: int = 0  # a quantized format: sequence slots with a float16 ring of recent blocks each

    def blocks_of(self, group: int) -> int:
        return self.group_blocks[group] if self.group_blocks else self.num_blocks

    def block_bytes(self, group: int) -> int:
        """K and V of one block in every layer of the group."""
        g = self.groups[group]
        return len(g.layer_ids) * g.spec.layout.block_bytes

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.groups)

    @property
    def dtype(self) -> torch.dtype:
        return self.groups[0].spec.layout.dtype

    @property
    def format_name(self) -> str:
        """The K/V storage's kv_cache_dtype name: float32, float16, int8, int4."""
        lay = self.groups[0].spec.layout
        return lay.quant or str(lay.dtype).replace("torch.", "")

    @property
    def layer_groups(self) -> list[int]:
        """Per layer, the index of its group."""
        out = [0] * self.num_layers
        for gi, g in enumerate(self.groups):
            for layer in g.layer_ids:
                out[layer] = gi
        return out

    @property
    def bytes_per_token(self) -> float:
        """K and V of one token in every layer (a quantized format: its blocks' bytes, scales included,
        averaged over the block; its rings are `ring_bytes` per sequence slot)."""
        return sum(len(g.layer_ids) * g.spec.layout.bytes_per_token for g in self.groups)

    @property
    def num_tokens(self) -> int | None:
        """The most tokens one sequence can hold (the groups that keep every block bound it); None when
        every group releases blocks (a sequence of any length holds at most each group's cap)."""
        if all(g.spec.bounded for g in self.groups):
            return None
        return self.num_blocks * self.block_size

    @property
    def score_rows(self) -> int:
        """Query rows per sequence and step whose attention scores its blocks (0: none; `KVCacheSpec.score_rows`)."""
        return max(g.spec.score_rows for g in self.groups)

    @property
    def group_attention(self) -> list[tuple[int | None, int]]:
        """Per group, the (window, sinks) its layers attend with (`KVCacheSpec.attention`)."""
        return [g.spec.attention for g in self.groups]

    @property
    def ring_bytes(self) -> int:
        """One sequence slot's float16 rings of recent tokens, every layer (0 for float formats)."""
        return sum(len(g.layer_ids) * g.spec.layout.ring_bytes for g in self.groups)

    @property
    def total_bytes(self) -> int:
        return (sum(self.blocks_of(g) * self.block_bytes(g) for g in range(len(self.groups)))
                + self.recent_slots * self.ring_bytes)

    def salt(self, group: int) -> bytes:
        return self.model_salt + b"|" + self.groups[group].spec.tag()

    def describe(self) -> str:
        return ", ".join(f"{g.spec.kind} × {len(g.layer_ids)} layers" +
                         (f" ({self.blocks_of(i)} blocks)" if self.blocks_of(i) != self.num_blocks else "")
                         for i, g in enumerate(self.groups))

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                  model_salt: bytes = b"", policy: "str | KVPolicyConfig" = "auto", max_num_seqs: int | None = None,
                  max_num_batched_tokens: int | None = None, spec_tokens: int = 0,
                  recent_window: int = 0) -> "KVCacheConfig":
        """The model's layers grouped by attention kind (full, or each sliding-window size), each group's
        spec as the KV policy builds it. Given `max_num_seqs` and `max_num_batched_tokens`, a group that
        releases blocks gets no more than it can hold at once (`KVCacheSpec.max_blocks`). A quantized
        `dtype` (torch.int8: int8, torch.uint8: int4) keeps `recent_window` tokens per sequence in float16,
        in one ring per sequence slot (`max_num_seqs` of them)."""
        from turbollm.engine.kv_policy import KVPolicyConfig, get_kv_policy

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
        return cls(num_blocks, block_size, groups, model_salt, counts if set(counts) != {num_blocks} else (),
                   (max_num_seqs or 1) if layout.quant else 0)

    @classmethod
    def from_budget(cls, cfg: ModelConfig, memory_bytes: int, block_size: int, dtype: torch.dtype = torch.float32,
                    model_salt: bytes = b"", policy: "str | KVPolicyConfig" = "auto", max_num_seqs: int | None = None,
                    max_num_batched_tokens: int | None = None, spec_tokens: int = 0,
                    recent_window: int = 0) -> "KVCacheConfig":
        """The most blocks for the groups that keep everything such that every group's blocks (and the
        recent rings of a quantized format) fit `memory_bytes` (the capped groups taking their cap first)."""
        def build(n: int) -> KVCacheConfig:
            return cls.for_model(cfg, n, block_size, dtype, model_salt, policy, max_num_seqs, max_num_batched_tokens,
                                 spec_tokens, recent_window)

        probe = build(1)
        if probe.total_bytes > memory_bytes:
            from turbollm.errors import InvalidRequestError

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
                      max_num_seqs: int, policy: "str | KVPolicyConfig" = "auto", max_num_batched_tokens: int | None = None,
                      spec_tokens: int = 0, recent_window: int = 0) -> int:
    """Bytes for `max_num_seqs` sequences of `max_model_len` tokens each (whole blocks; a group that
    releases blocks no more than its cap): the most a default-sized cache can ever use, so a small
    model with a short context is not given gigabytes."""
    per_seq = -(-max_model_len // block_size)
    return KVCacheConfig.for_model(cfg, per_seq * max_num_seqs, block_size, dtype, b"", policy, max_num_seqs,
                                   max_num_batched_tokens, spec_tokens, recent_window).total_bytes


def allocate_kv_storage(config: KVCacheConfig, layers: range | None = None) -> list[LayerKVCache | None]:
    """Each layer's zeroed K/V storage, its group's blocks of its group's layout; with `layers` (a
    pipeline stage's), those layers' only (None for the others)."""
    out: list[LayerKVCache | None] = [None] * config.num_layers
    for gi, g in enumerate(config.groups):
        for layer in g.layer_ids:
            if layers is None or layer in layers:
                out[layer] = LayerKVCache.allocate(g.spec.layout, config.blocks_of(gi), config.recent_slots)
    return out
