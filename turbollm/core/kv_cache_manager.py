"""The KV-cache manager: a sequence's blocks in each group's pool — growth, release out of a
sliding window, the prefix cache, copy-on-write.

The scheduler decides who runs; this decides which blocks they hold. Each KV-cache group
(`kv_cache_spec.py`) has its own `BlockPool`, and a sequence one block table per group, all of
the same length: a table covers the sequence's computed tokens plus the ones scheduled this
step. A sliding-window group releases the blocks its window has moved past (their table entries
become `NULL_BLOCK`); a full-attention group keeps every block until the sequence ends.

The prefix cache (taking a new sequence's longest cached prefix, indexing full blocks, a KV connector's
blocks) is `prefix_cache.py`'s, mixed in. A block shared with another sequence (n > 1 siblings) is copied
before a sequence writes into it, in every group.

Under an attention-score eviction policy (`kv_eviction.py`) a sequence's table is compacted as
blocks are evicted (`evict`): it lists the kept blocks in order, and position p of the blocks after
the last evicted one (where new tokens go) is at entry p // block_size - evicted_blocks. An evicted
sequence's blocks are no longer indexed in the prefix cache.
"""

from __future__ import annotations

import copy
import hashlib

from turbollm.core.block_pool import NULL_BLOCK, BlockPool, CacheStats
from turbollm.core.kv_eviction import EvictionSpec, Evictor
from turbollm.core.prefix_cache import PrefixCaching
from turbollm.core.sequence import Sequence
from turbollm.handoff.kv_cache_spec import KVCacheConfig, KVCacheSpec


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


class KVCacheManager(PrefixCaching):
    def __init__(self, block_size: int, pools: list[BlockPool], specs: list[KVCacheSpec | None] | None = None,
                 salts: list[bytes] | None = None, root: bytes = b"", block_bytes: list[int] | None = None,
                 ring_blocks: int = 0, num_ring_slots: int = 0):
        self.block_size, self.pools = block_size, pools
        self.specs = specs or [None] * len(pools)  # None: full attention
        self.keys = [_digest(s) for s in salts] if salts else [b""] * len(pools)
        self.root = _digest(root) if root else None
        self.block_bytes = block_bytes or [0] * len(pools)  # K/V bytes of one block of each group
        # a quantized format: each running sequence's float16 ring of recent tokens is ring slot s, blocks
        # s * ring_blocks .. (s + 1) * ring_blocks - 1 of every pool, taken while it runs (`take_rings`)
        self.ring_blocks, self.num_ring_slots = ring_blocks, num_ring_slots
        self.ring_of: dict[int, int] = {}  # seq_id -> its ring slot
        self.spare_rings: dict[int, list[int]] = {}  # seq_id -> ring slots held for the siblings it will fork
        self.holding: set[int] = set()  # sequences with blocks
        self.peak_bytes = 0  # the most K/V bytes in use at once since start (`note_usage`)
        # attention-score eviction: the policy's evictor (its groups all evict alike; None: no eviction)
        spec = next((s for s in self.specs if isinstance(s, EvictionSpec)), None)
        self.evictor = Evictor(spec) if spec is not None else None
        self.num_evicted_blocks = 0  # blocks evicted since start (every group's count once)
        self.stats = CacheStats()
        self.connector = None  # a KV connector's scheduler half (core/kv_connector.py), set by the engine
        for p in pools:
            p.stats = self.stats  # evictions from every group land in one set of counters

    @classmethod
    def from_config(cls, config: KVCacheConfig, enable_caching: bool = True) -> "KVCacheManager":
        pools = [BlockPool(config.blocks_of(g), enable_caching) for g in range(len(config.groups))]
        return cls(config.block_size, pools, [g.spec for g in config.groups],
                   [config.salt(i) for i in range(len(config.groups))], config.model_salt,
                   [config.block_bytes(g) for g in range(len(config.groups))], config.ring_blocks, config.ring_slots)

    # ---------------------------------------------------------------- pool state
    @property
    def num_groups(self) -> int:
        return len(self.pools)

    @property
    def enable_caching(self) -> bool:
        return self.pools[0].enable_caching

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    @property
    def num_used(self) -> int:
        return sum(p.num_used for p in self.pools)

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self.pools)

    @property
    def usage(self) -> float:
        """The fullest group's share of its blocks in use (what limits admission)."""
        return max(p.usage for p in self.pools)

    @property
    def bytes_used(self) -> int:
        """K/V bytes of the blocks in use, every group (the rings' blocks included)."""
        return sum(p.num_used * b for p, b in zip(self.pools, self.block_bytes))

    @property
    def num_rings(self) -> int:
        """Ring slots taken (running sequences', and those held for siblings to fork)."""
        return len(self.ring_of) + sum(map(len, self.spare_rings.values()))

    # ---------------------------------------------------------------- rings of a quantized format
    def rings_needed(self, seq: Sequence) -> int:
        """Ring slots `seq` still needs: its own and one per sibling it will fork (0 for float formats)."""
        if not self.ring_blocks:
            return 0
        return (seq.seq_id not in self.ring_of) + seq.pending_forks - len(self.spare_rings.get(seq.seq_id, ()))

    def take_rings(self, seq: Sequence) -> bool:
        """Take the ring slots `seq` needs out of every pool: slots whose blocks are all free, from the top of
        the pools down (blocks are handed out from the bottom). False, with nothing taken, when too few are."""
        k = self.rings_needed(seq)
        if k <= 0:
            return True
        slots = []
        for s in range(self.num_ring_slots - 1, -1, -1):
            if all(p.ref_counts[b] == 0 for p in self.pools for b in self._ring_range(s)):
                slots.append(s)
                if len(slots) == k:
                    break
        else:
            return False
        for s in slots:
            for p in self.pools:
                for b in self._ring_range(s):
                    p.take(b)
        if seq.seq_id not in self.ring_of:
            self.ring_of[seq.seq_id] = slots.pop(0)
        if slots:
            self.spare_rings.setdefault(seq.seq_id, []).extend(slots)
        self.holding.add(seq.seq_id)
        return True

    def fork_ring(self, parent: Sequence, i: int) -> int:
        """The ring slot held for `parent`'s i-th sibling to be (-1 for float formats)."""
        spare = self.spare_rings.get(parent.seq_id)
        return spare[i] if spare else -1

    def _ring_range(self, slot: int) -> range:
        return range(slot * self.ring_blocks, (slot + 1) * self.ring_blocks)

    def _give_back_rings(self, seq_id: int) -> None:
        for s in [self.ring_of.pop(seq_id, None)] + self.spare_rings.pop(seq_id, []):
            if s is not None:
                for p in self.pools:
                    p.give_back(self._ring_range(s))

    def note_usage(self) -> None:
        """Fold the current use into `peak_bytes` (the scheduler calls it once per step)."""
        self.peak_bytes = max(self.peak_bytes, self.bytes_used)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether every group has `num_blocks` free blocks."""
        return all(p.num_free >= num_blocks for p in self.pools)

    # ---------------------------------------------------------------- tables
    def tables(self, seq: Sequence) -> list[list[int]]:
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.pools]
        return seq.block_tables

    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        """New blocks each group needs for `num_new` more tokens (the same in every group)."""
        total = seq.num_computed_tokens + num_new
        return max(0, -(-total // self.block_size) - seq.evicted_blocks - len(self.tables(seq)[0]))

    def grow(self, seq: Sequence, num_new: int) -> None:
        self.holding.add(seq.seq_id)
        n = self.blocks_needed(seq, num_new)
        for pool, table in zip(self.pools, self.tables(seq)):
            table.extend(pool.allocate() for _ in range(n))

    def release_out_of_window(self, seq: Sequence) -> list[tuple[int, int]]:
        """Release the blocks a sliding-window group can no longer see (before the first position the
        next new token attends to); returns (group, table position) of each entry now NULL_BLOCK.
        Released entries are always a run just after the kept blocks (sinks; none for a plain window):
        the walk starts at the window and goes back to the first entry already released, so a long
        sequence costs only what it releases."""
        out = []
        for g, (spec, pool, table) in enumerate(zip(self.specs, self.pools, self.tables(seq))):
            if spec is None or not spec.releases_blocks:
                continue
            i = min(spec.first_needed_position(seq.num_computed_tokens) // self.block_size, len(table)) - 1
            gone, keep = [], spec.kept_blocks()
            while i >= keep and table[i] != NULL_BLOCK:
                gone.append(i)
                i -= 1
            for i in reversed(gone):  # oldest first, as the pool's free queue takes them
                pool.release([table[i]])
                table[i] = NULL_BLOCK
                out.append((g, i))
        return out

    def shared_write_block(self, seq: Sequence) -> int | None:
        """Position in the tables of the block `seq` writes next, if another sequence shares it (forks share
        the same positions in every group)."""
        idx = seq.num_computed_tokens // self.block_size - seq.evicted_blocks
        for pool, table in zip(self.pools, self.tables(seq)):
            if idx < len(table) and table[idx] != NULL_BLOCK and pool.ref_counts[table[idx]] > 1:
                return idx
        return None

    def copy_on_write(self, seq: Sequence, idx: int) -> list[tuple[int, int, int]]:
        """Give `seq` its own copy of shared block `idx` in every group; (group, src, dst) to copy."""
        out = []
        for g, (pool, table) in enumerate(zip(self.pools, self.tables(seq))):
            src = table[idx]
            if src == NULL_BLOCK or pool.ref_counts[src] == 1:
                continue
            dst = pool.allocate()
            pool.release([src])
            table[idx] = dst
            out.append((g, src, dst))
        return out

    def share(self, parent: Sequence, child: Sequence, ring_slot: int = -1) -> None:
        """`child` takes the parent's blocks (an n > 1 fork): same tables, one more reference each; and the
        ring slot held for it (`fork_ring`)."""
        if ring_slot >= 0:
            self.spare_rings[parent.seq_id].remove(ring_slot)
            self.ring_of[child.seq_id] = ring_slot
        child.block_tables = [list(t) for t in self.tables(parent)]
        self.holding.add(child.seq_id)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.evicted_blocks = parent.evicted_blocks
        child.kv_score_state = copy.deepcopy(parent.kv_score_state)
        for pool, table in zip(self.pools, child.block_tables):
            for b in table:
                pool.touch(b)

    def free(self, seq: Sequence) -> None:
        for pool, table in zip(self.pools, seq.block_tables):
            pool.release(table)
        self._give_back_rings(seq.seq_id)
        self.holding.discard(seq.seq_id)
        seq.block_tables = []
        seq.num_cached_blocks = 0
        seq.num_blocks_sent = 0
        seq.evicted_blocks, seq.kv_score_state, seq.pending_evictions = 0, None, []

    # ---------------------------------------------------------------- attention-score eviction
    def observe_scores(self, seq: Sequence, rows: int, mass: list[float]) -> None:
        """A step's attention mass per table entry of `seq` (`rows` query rows counted), for its scorer."""
        if self.evictor is not None:
            self.evictor.observe(seq, rows, mass)

    def evict(self, seq: Sequence) -> list[int]:
        """Release the blocks of `seq` its evictor chooses (beyond its budget, never its newest `recent` tokens);
        returns the table positions removed, descending (the workers delete them in this order)."""
        if self.evictor is None or not seq.block_tables:
            return []
        tables = self.tables(seq)
        gone = self.evictor.choose(seq, len(tables[0]), self.block_size)
        if not gone:
            return []
        for pool, table in zip(self.pools, tables):
            for i in gone:  # descending: each deletion leaves the positions still to delete in place
                pool.release([table[i]])
                del table[i]
        self.evictor.removed(seq, gone)
        seq.evicted_blocks += len(gone)
        seq.num_blocks_sent -= sum(1 for i in gone if i < seq.num_blocks_sent)
        self.num_evicted_blocks += len(gone)
        return gone
