"""The KV-cache manager's prefix cache: a new sequence takes the longest prefix every group holds, and full
blocks are indexed as they are computed (mixed into `KVCacheManager`, core/kv_cache_manager.py, which holds
the pools, their keys and the tables).

Full blocks are indexed in each group's prefix cache by a digest chained over every token before them
(`block_pool.hash_block`), rooted in the model's salt and keyed per group with the group's spec (KV dtype,
layout, window), so a new sequence can start from the longest prefix that every group still holds (always
leaving one token to compute) — a sliding-window group only the blocks its window still sees from there, its
older entries `NULL_BLOCK`. With a KV connector (core/kv_connector.py), blocks the pools miss but the outside
holds count too: the sequence gets fresh blocks for them, returned as loads, and they enter the index once
they arrived (`cache_loaded_blocks`); every block entering the index is handed to the connector (to save).
"""

from __future__ import annotations

from turbollm.core.block_pool import NULL_BLOCK, hash_block
from turbollm.core.sequence import Sequence
from turbollm.handoff.kv_transfer import KVBlockRef

EXTERNAL = -2  # a prefix position whose block the KV connector holds (loaded into a fresh block)


class PrefixCaching:
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Prefix keys of the sequence's first `num_blocks` full blocks (computed once, kept)."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = [seq.token_at(t) for t in range(i * bs, (i + 1) * bs)]
            hashes.append(hash_block(hashes[-1] if hashes else self.root, tokens))
        return hashes

    def take_cached_prefix(self, seq: Sequence, external: bool = True) -> list[KVBlockRef]:
        """Point a fresh sequence at the cached blocks of its longest prefix that every group holds — a
        group that releases blocks out of its window only those the next token's window sees (counted
        in the stats by `count_admitted`, once the sequence is admitted). With a KV connector, blocks the
        pools miss but the outside holds count too: each gets a fresh block, returned as a load to do
        before the sequence runs (none when the pools lack free blocks for them all)."""
        if not self.enable_caching or seq.num_computed_tokens or seq.block_tables:
            return []
        if seq.params.prompt_logprobs is not None:  # needs the logits of every prompt position
            return []
        ask = self.connector if external and not seq.external_failed and self.connector is not None \
            and self.connector.looks_up_prefixes else None
        max_blocks = (seq.num_tokens - 1) // self.block_size  # at least one token must be computed
        hashes = self._hashes(seq, max_blocks)
        found: list[list[int | None]] = []  # per group, the block of each prefix position (None: missing)
        n = max_blocks
        for g, (pool, key) in enumerate(zip(self.pools, self.keys)):
            if self._releases(g):
                blocks = [pool.lookup(key + h) for h in hashes[:n]]
                miss = [i for i, b in enumerate(blocks) if b is None]
                if ask is not None and miss:
                    for i, there in zip(miss, ask.lookup([key + hashes[i] for i in miss])):
                        blocks[i] = EXTERNAL if there else None
                found.append(blocks)
                continue
            blocks = []
            for h in hashes[:n]:  # a group that keeps every block needs them all, from the first
                block = pool.lookup(key + h)
                if block is None and ask is not None and ask.lookup([key + h])[0]:
                    block = EXTERNAL
                if block is None:
                    break
                blocks.append(block)
            found.append(blocks)
            n = len(blocks)
        windowed = [g for g in range(self.num_groups) if self._releases(g)]
        while windowed:  # the longest hit whose window every windowed group holds (a shorter hit moves
            # every window back: check them all again until none shortens it)
            m = n
            for g in windowed:
                m = self._window_hit(g, found[g], m)
            if m == n:
                break
            n = m
        used = [[i for i in range(n) if i >= self._first_needed_block(g, n) or i < self._kept_blocks(g)]
                for g in range(self.num_groups)]
        loads = [[i for i in used[g] if found[g][i] == EXTERNAL] for g in range(self.num_groups)]
        if any(len(ld) > pool.num_free for ld, pool in zip(loads, self.pools)):
            return self.take_cached_prefix(seq, external=False)  # no room to load into: the pools' hit alone
        tables = self.tables(seq)
        for g, (pool, blocks, table) in enumerate(zip(self.pools, found, tables)):
            table.extend([NULL_BLOCK] * n)
            for i in used[g]:
                if blocks[i] != EXTERNAL:
                    pool.touch(blocks[i])  # (every hit taken before any block is allocated: none is evicted)
                    table[i] = blocks[i]
        refs = []
        for g, (pool, key, table) in enumerate(zip(self.pools, self.keys, tables)):
            for i in loads[g]:
                table[i] = pool.allocate()
                refs.append(KVBlockRef(g, table[i], key + hashes[i]))
        first_load = min((ld[0] for ld in loads if ld), default=n)
        seq.num_cached_blocks = first_load  # the loaded blocks enter the prefix cache once they arrived
        seq.num_computed_tokens = n * self.block_size
        return refs

    def take_remote_prefix(self, seq: Sequence, num_tokens: int) -> list[list[tuple[int, int]]] | None:
        """The first `num_tokens` tokens of a fresh sequence, whose K/V come from a producer (a p2p KV connector):
        the prefix the pools hold first (a hit, as for any sequence), then fresh blocks for the rest, in each
        group the positions its next token sees (a sliding group's window and sinks, the rest `NULL_BLOCK`).
        Returns the (table position, block) pairs to load, per group; None, with nothing taken, when the pools
        lack the blocks."""
        if seq.num_computed_tokens or seq.block_tables:
            return None
        self.take_cached_prefix(seq, external=False)
        bs, nb, hit = self.block_size, -(-num_tokens // self.block_size), seq.num_cached_blocks
        load = []
        for spec in self.specs:
            first = spec.first_needed_position(num_tokens) // bs if spec is not None else 0
            keep = spec.kept_blocks() if spec is not None else 0
            load.append([i for i in range(hit, nb) if i >= first or i < keep])  # (those below `hit` are held)
        if any(len(u) > pool.num_free for u, pool in zip(load, self.pools)):
            self.free(seq)
            seq.num_computed_tokens = 0
            return None
        positions = []
        for pool, table, u in zip(self.pools, self.tables(seq), load):
            table.extend([NULL_BLOCK] * (nb - len(table)))
            for i in u:
                table[i] = pool.allocate()
            positions.append([(i, table[i]) for i in u])
        self.holding.add(seq.seq_id)
        seq.num_computed_tokens = num_tokens
        return positions

    def cache_loaded_blocks(self, refs: list[KVBlockRef]) -> None:
        """Index blocks a KV connector loaded, under the keys they were loaded by (each group's key + hash)."""
        for ref in refs:
            self.pools[ref.group].cache_full_block(ref.block, ref.key)

    def _releases(self, group: int) -> bool:
        spec = self.specs[group]
        return spec is not None and spec.releases_blocks

    def _first_needed_block(self, group: int, num_blocks: int) -> int:
        """The first block a group needs after a hit of `num_blocks` blocks (0 for a group keeping all)."""
        spec = self.specs[group]
        return spec.first_needed_position(num_blocks * self.block_size) // self.block_size if spec else 0

    def _kept_blocks(self, group: int) -> int:
        spec = self.specs[group]
        return spec.kept_blocks() if spec else 0

    def _window_hit(self, group: int, blocks: list[int | None], n: int) -> int:
        """The longest hit m <= n whose kept blocks (sinks) 0 .. kept - 1 and window blocks first_needed(m) ..
        m - 1 the group holds (`blocks`)."""
        keep = self._kept_blocks(group)
        while n > 0:
            missing = next((i for i in range(n - 1, -1, -1) if blocks[i] is None), -1)
            if missing < self._first_needed_block(group, n):
                sink_gap = next((i for i in range(min(keep, n)) if blocks[i] is None), None)
                if sink_gap is None:
                    return n
                n = sink_gap  # shorter hits lie within the kept blocks, all present before the gap
                continue
            n = missing  # a longer hit's window starts no earlier, so it would hold the gap too
        return 0

    def count_admitted(self, seq: Sequence) -> None:
        """Prefix-cache stats of an admitted sequence (a lookup refused for lack of blocks is not counted)."""
        if self.enable_caching and seq.params.prompt_logprobs is None:
            self.stats.queries += seq.num_tokens
            self.stats.hits += seq.num_computed_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """After a step: index the sequence's newly full blocks in each group's prefix cache."""
        if not self.enable_caching or seq.evicted_blocks:
            return
        tables = self.tables(seq)
        ready = min(spec.cacheable_tokens(seq.num_computed_tokens) if spec else seq.num_computed_tokens
                    for spec in self.specs)  # a quantized format's recent tokens are not in the pool yet
        full = min(ready // self.block_size, len(tables[0]))
        if full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, full)
        for g, (pool, key, table) in enumerate(zip(self.pools, self.keys, tables)):
            for i in range(seq.num_cached_blocks, full):
                if table[i] != NULL_BLOCK and pool.cache_full_block(table[i], key + hashes[i]) \
                        and self.connector is not None:
                    self.connector.block_cached(g, table[i], key + hashes[i])
        seq.num_cached_blocks = full
