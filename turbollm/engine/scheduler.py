"""The scheduler: one rule, bring each sequence's computed tokens up to its tokens, under a budget.

Each step it first continues running sequences (decodes, and prompts being prefilled in
chunks), oldest first, then admits waiting ones while the token budget
(`max_num_batched_tokens`), the sequence cap (`max_num_seqs`) and free KV blocks allow.
An admitted sequence first takes whatever prefix of it the prefix cache holds (its
computed count starts there). A prompt longer than the remaining budget is prefilled in
chunks over several steps. When a running sequence needs a block and none is free, the
newest running sequence is preempted: its blocks return to the pool and it goes back to
the front of the queue, to be recomputed later. A shared block that a sequence is about
to write into is copied first (copy-on-write).

Every step makes progress or says why not: a sequence that cannot fit in the whole pool even
with nothing else running (which the engine's cap of `max_model_len` to the pool rules out, so
this is a last line of defence) is taken out and reported in `SchedulerOutput.unschedulable`
instead of preempting itself forever. An n > 1 request's siblings-to-be (`pending_forks`)
take their `max_num_seqs` slots when the prompt is admitted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from turbollm.engine.kv_cache import BlockPool, hash_block
from turbollm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt_or_decodes(self) -> bool:
        """True when, after this step, every token of the sequence is in the cache (sample next)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward pass
    # sequences that cannot fit in the whole KV pool: removed from the schedule, to be ended with an error
    unschedulable: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool, self.block_size = pool, block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Add a sequence that already holds blocks (a forked sibling) straight to the running set."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_seq_slots(self) -> int:
        """Sequence slots taken: every running sequence plus the siblings its prompt will fork."""
        return sum(1 + s.pending_forks for s in self.running)

    # ------------------------------------------------------------------ blocks
    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = seq.num_computed_tokens + num_new
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def _grow(self, seq: Sequence, num_new: int) -> None:
        for _ in range(self._blocks_needed(seq, num_new)):
            seq.block_table.append(self.pool.allocate())

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index in the block table of the block `seq` writes next, if another sequence shares it."""
        idx = seq.num_computed_tokens // self.block_size
        if idx < len(seq.block_table) and self.pool.ref_counts[seq.block_table[idx]] > 1:
            return idx
        return None

    def _copy_on_write(self, seq: Sequence, idx: int, out: SchedulerOutput) -> None:
        """Give `seq` its own copy of shared block `idx` before it writes there."""
        src = seq.block_table[idx]
        dst = self.pool.allocate()
        self.pool.release([src])
        seq.block_table[idx] = dst
        out.copy_blocks.append((src, dst))

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Prefix keys of the sequence's first `num_blocks` full blocks (computed once, kept)."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = [seq.token_at(t) for t in range(i * bs, (i + 1) * bs)]
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
        return hashes

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """Point a fresh sequence at the cached blocks of its longest cached prefix (counted in the
        pool's stats by `_admit`, once the sequence is admitted)."""
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

    def free_blocks(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                continue
            shared = self._shared_write_block(seq)
            need = self._blocks_needed(seq, n) + (shared is not None)
            while need > self.pool.num_free and self.running[-1] is not seq:
                self._preempt(self.running[-1], out)
            if need > self.pool.num_free:
                if self.running[0] is seq:  # alone, and still too big: it can never run
                    self._drop(seq, out)
                else:
                    self._preempt(seq, out)
                continue
            if shared is not None:
                self._copy_on_write(seq, shared, out)
            self._grow(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        while self.waiting and budget > 0 and self.num_seq_slots + 1 + self.waiting[0].pending_forks <= self.max_num_seqs:
            seq = self.waiting[0]
            self._take_cached_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._blocks_needed(seq, n) > self.pool.num_free:
                self.free_blocks(seq)
                seq.num_computed_tokens = 0
                if self.running:  # blocks come back as the running sequences finish
                    break
                self._drop(seq, out)  # the whole pool is free and still too small
                continue
            self.waiting.popleft()
            self._admit(seq)
            self._grow(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _admit(self, seq: Sequence) -> None:
        if self.pool.enable_caching and seq.params.prompt_logprobs is None:
            self.pool.stats.queries += seq.num_tokens
            self.pool.stats.hits += seq.num_computed_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _drop(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take out a sequence that cannot fit in the whole pool; the engine ends it with an error."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free_blocks(seq)
        seq.num_computed_tokens = 0
        out.unschedulable.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free_blocks(seq)
        seq.status = SequenceStatus.FINISHED
