"""The KV-cache manager: a sequence's blocks in the pool — growth, the prefix cache, copy-on-write.

The scheduler decides who runs; this decides which blocks they hold. A sequence's block table
covers its computed tokens plus the ones scheduled this step. Full blocks are indexed in the
prefix cache by a digest chained over every token before them (`kv_cache.hash_block`), so a new
sequence can start from the longest cached prefix of its tokens (always leaving one token to
compute). A block shared with another sequence (n > 1 siblings) is copied before a sequence
writes into it.
"""

from __future__ import annotations

from turbollm.engine.kv_cache import BlockPool, hash_block
from turbollm.engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.block_size = pool, block_size

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = seq.num_computed_tokens + num_new
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def grow(self, seq: Sequence, num_new: int) -> None:
        for _ in range(self.blocks_needed(seq, num_new)):
            seq.block_table.append(self.pool.allocate())

    def shared_write_block(self, seq: Sequence) -> int | None:
        """Index in the block table of the block `seq` writes next, if another sequence shares it."""
        idx = seq.num_computed_tokens // self.block_size
        if idx < len(seq.block_table) and self.pool.ref_counts[seq.block_table[idx]] > 1:
            return idx
        return None

    def copy_on_write(self, seq: Sequence, idx: int) -> tuple[int, int]:
        """Give `seq` its own copy of shared block `idx` before it writes there; (src, dst) to copy."""
        src = seq.block_table[idx]
        dst = self.pool.allocate()
        self.pool.release([src])
        seq.block_table[idx] = dst
        return src, dst

    def share(self, parent: Sequence, child: Sequence) -> None:
        """`child` takes the parent's blocks (an n > 1 fork): same table, one more reference each."""
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        for b in child.block_table:
            self.pool.touch(b)

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Prefix keys of the sequence's first `num_blocks` full blocks (computed once, kept)."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = [seq.token_at(t) for t in range(i * bs, (i + 1) * bs)]
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
        return hashes

    def take_cached_prefix(self, seq: Sequence) -> None:
        """Point a fresh sequence at the cached blocks of its longest cached prefix (counted in the
        pool's stats by `count_admitted`, once the sequence is admitted)."""
        if not self.pool.enable_caching or seq.num_computed_tokens or seq.block_table:
            return
        if seq.params.prompt_logprobs is not None:  # needs the logits of every prompt position
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size  # at least one token must be computed
        for h in self._hashes(seq, max_blocks):
            block = self.pool.lookup(h)
            if block is None:
                break
            self.pool.touch(block)
            seq.block_table.append(block)
        seq.num_computed_tokens = seq.num_cached_blocks = len(seq.block_table)
        seq.num_computed_tokens *= self.block_size

    def count_admitted(self, seq: Sequence) -> None:
        """Prefix-cache stats of an admitted sequence (a lookup refused for lack of blocks is not counted)."""
        if self.pool.enable_caching and seq.params.prompt_logprobs is None:
            self.pool.stats.queries += seq.num_tokens
            self.pool.stats.hits += seq.num_computed_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """After a step: index the sequence's newly full blocks in the prefix cache."""
        if not self.pool.enable_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            self.pool.cache_full_block(seq.block_table[i], hashes[i])
        seq.num_cached_blocks = full

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_blocks_sent = 0
