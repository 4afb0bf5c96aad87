"""What the KV cache is made of: layer groups, each with its spec, and the blocks each group gets.

Layers whose K/V are kept alike form a group (`KVCacheGroup`): full attention, or a sliding
window of a given size (Gemma 3: 15 sliding layers of 512 tokens and 3 full ones make two groups).
Each group has its own block pool and each sequence its own block table per group, so a group can
hold blocks by its own rule: a sliding-window group releases the blocks its window no longer
sees (`KVCacheSpec.first_needed_position`), the full-attention group keeps them all.

A releasing group never holds more than `SlidingWindowSpec.max_blocks` blocks (every sequence slot
a window's worth, plus the step's new tokens), so its pool is capped there and the rest of the
budget goes to the groups that keep everything (`core/kv_sizing.py`): Gemma 3's KV at 4k
context is about a quarter of all-full. The KV policy (`core/kv_policy.py`) builds each group's
spec: "dense" keeps a sliding group's blocks too (the unreleased baseline).

The spec is plain data: the scheduler side sizes it (`core/kv_sizing.py`) and sends it to the workers, which
allocate each layer's `LayerKVCache` from it (`worker/kv_allocation.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from turbollm.attention.kv_storage import KVLayout


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
        blocks (0: no scores; an eviction policy's `core/kv_eviction.py`)."""
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
        tokens), plus its float16 ring's blocks under a quantized format. Summed over the sequence slots,
        with the n's of a step summing to the token budget."""
        if not self.release_blocks:
            return None
        bs = self.layout.block_size
        per_slot = (-(-(self.window - 1) // bs) + 3 + -(-spec_tokens // bs) + self.kept_blocks()
                    + (self.layout.ring_pool_blocks if self.layout.quant else 0))
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
        averaged over the block; a running sequence's ring takes `ring_blocks` more blocks)."""
        return sum(len(g.layer_ids) * g.spec.layout.bytes_per_token for g in self.groups)

    @property
    def num_tokens(self) -> int | None:
        """The tokens the pool holds (the groups that keep every block bound it; a quantized format's running
        sequences' rings take some of it); None when every group releases blocks (a sequence of any length
        holds at most each group's cap)."""
        if all(g.spec.bounded for g in self.groups):
            return None
        return self.num_blocks * self.block_size

    @property
    def max_seq_tokens(self) -> int | None:
        """The most tokens one sequence can hold: the pool's, less its own ring's blocks (None: any length)."""
        held = self.num_tokens
        return None if held is None else max(0, held - self.ring_blocks * self.block_size)

    @property
    def score_rows(self) -> int:
        """Query rows per sequence and step whose attention scores its blocks (0: none; `KVCacheSpec.score_rows`)."""
        return max(g.spec.score_rows for g in self.groups)

    @property
    def group_attention(self) -> list[tuple[int | None, int]]:
        """Per group, the (window, sinks) its layers attend with (`KVCacheSpec.attention`)."""
        return [g.spec.attention for g in self.groups]

    @property
    def ring_blocks(self) -> int:
        """Blocks of every group one running sequence's float16 ring of recent tokens takes from the pool (a
        quantized format; 0 for float formats): ring slot s is blocks s * ring_blocks .. of each group."""
        return self.groups[0].spec.layout.ring_pool_blocks

    @property
    def ring_slots(self) -> int:
        """Ring slots the pools can hold at most (those of the smallest group)."""
        lay = self.groups[0].spec.layout
        return min(lay.ring_slots(self.blocks_of(g)) for g in range(len(self.groups)))

    @property
    def total_bytes(self) -> int:
        return sum(self.blocks_of(g) * self.block_bytes(g) for g in range(len(self.groups)))

    def salt(self, group: int) -> bytes:
        return self.model_salt + b"|" + self.groups[group].spec.tag()

    def describe(self) -> str:
        return ", ".join(f"{g.spec.kind} × {len(g.layer_ids)} layers" +
                         (f" ({self.blocks_of(i)} blocks)" if self.blocks_of(i) != self.num_blocks else "")
                         for i, g in enumerate(self.groups))
