"""The scheduler: one rule, bring each sequence's computed tokens up to its tokens, under a budget.

Each step it first continues running sequences (decodes, and prompts being prefilled in
chunks), oldest first, then admits waiting ones while the token budget
(`max_num_batched_tokens`), the sequence cap (`max_num_seqs`) and free KV blocks allow.
A prompt longer than the remaining budget is prefilled in chunks over several steps.
When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks return to the pool and it goes back to the front of the queue, to
be recomputed later. Nothing is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from turbollm.engine.kv_cache import BlockPool
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

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = seq.num_computed_tokens + num_new
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def _grow(self, seq: Sequence, num_new: int) -> None:
        for _ in range(self._blocks_needed(seq, num_new)):
            seq.block_table.append(self.pool.allocate())

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def free_blocks(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                continue
            while self._blocks_needed(seq, n) > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            self._grow(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._blocks_needed(seq, n) > self.pool.num_free:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._grow(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free_blocks(seq)
        seq.status = SequenceStatus.FINISHED
