"""The block pool of one KV-cache group, with prefix caching.

A sequence's block table (one per group) lists its blocks in order, so token t lives in slot
`block_table[t // block_size] * block_size + t % block_size` of every layer of the group
(`attention/kv_storage.py`). A table entry `NULL_BLOCK` is a block the group released because
no new token can see it any more (a sliding window moved past it); kernels never read it.

The pool owns every block's reference count. With prefix caching on, a block whose
`block_size` tokens are all computed is indexed by a hash chained over the tokens of every
block before it (so equal hashes mean equal prefixes, hence equal K/V). When its last
user releases it, a hashed block keeps its contents and its index entry and waits in the
free queue; a later request with the same prefix takes it back (a hit) and the
allocator only reuses it — evicting the entry — when it reaches the front of the queue,
least recently released first. A block shared by several sequences (reference count > 1)
is never written: the scheduler copies it first (copy-on-write).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from turbollm.handoff.scheduler_output import NULL_BLOCK  # noqa: F401 - the pool's tables hold it


def hash_block(parent: bytes | None, tokens: list[int], extra: bytes = b"") -> bytes:
    """The prefix-cache key of a full block: a digest of the parent block's key and its tokens."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


@dataclass
class CacheStats:
    """Prefix-cache counters, in tokens (queries: prompt tokens looked up; hits: found cached)."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0  # cached blocks whose entry was dropped to reuse the block

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Reference-counted blocks, an LRU free queue, and the hash index of full blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # front = reused first
        self.cached: dict[bytes, int] = {}
        self.stats = CacheStats()

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self) -> int:
        """Take the block at the front of the free queue (evicting its cache entry, if any)."""
        if not self.free:
            raise RuntimeError("no free KV-cache block")  # the scheduler checks first
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
            self.stats.evictions += 1
        self.ref_counts[block] = 1
        return block

    def take(self, block: int) -> None:
        """Take free block `block` itself (a ring slot's range: `KVCacheManager.take_rings`), evicting its cache
        entry, if any."""
        self.free.move_to_end(block, last=False)
        taken = self.allocate()
        assert taken == block

    def give_back(self, blocks: range) -> None:
        """Blocks taken with `take` (a ring slot's) go back, to the end of the free queue: reused last, so that
        their range stays whole for the next ring as long as other blocks are free."""
        for b in blocks:
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] == 0, f"ring block {b} shared"
            self.free[b] = None

    def lookup(self, h: bytes) -> int | None:
        """The cached block holding the prefix `h`, or None."""
        return self.cached.get(h) if self.enable_caching else None

    def touch(self, block: int) -> None:
        """Add a user to `block` (taking it out of the free queue if it was idle)."""
        if block == NULL_BLOCK:
            return
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one user of each block; idle blocks join the free queue, tail blocks first in line."""
        for b in reversed(blocks):
            if b == NULL_BLOCK:
                continue
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} released twice"
            if self.ref_counts[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:  # nothing worth keeping: reuse it first
                    self.free.move_to_end(b, last=False)

    def cache_full_block(self, block: int, h: bytes) -> bool:
        """Index a block whose tokens are all computed under its prefix hash `h`; whether it is new in the index."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return False
        if h in self.cached:
            return False
        self.cached[h] = block
        self.block_hash[block] = h
        return True
