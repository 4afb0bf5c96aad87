"""n > 1 on the scheduler side, one object: a request's first sequence computes the prompt, and when the step
that completes it samples, its siblings fork off it, sharing its blocks (copy-on-write later).

The siblings-to-be (`Sequence.pending_forks`) take their `max_num_seqs` slots, and under a quantized K/V format
their rings, when the prompt is admitted (`slots`); the step that completes the prompt names them (`plan`:
`SchedulerOutput.forks`, each with its seq_id, index and ring slot), the workers make their states when they
sample it, and `complete` creates them here once the parent's sample came back (if it failed, there is no
fork: the workers drop the siblings they made). The worker side is `ModelRunner._fork_state` and
`RecentRings.fork` (worker/model_runner.py, worker/kv_rings.py).
"""

from __future__ import annotations

from typing import Callable

from turbollm.core.sequence import Sequence
from turbollm.handoff.scheduler_output import ForkData


class Forking:
    def __init__(self, kv, next_seq_id: Callable[[], int]):
        self.kv, self.next_seq_id = kv, next_seq_id

    @staticmethod
    def slots(seq: Sequence) -> int:
        """Sequence slots `seq` takes: itself and the siblings its prompt will fork."""
        return 1 + seq.pending_forks

    def plan(self, seq: Sequence, num_new: int) -> list[ForkData]:
        """The siblings to fork off `seq` when its `num_new` tokens this step complete its prompt (else none)."""
        if not seq.pending_forks or seq.num_computed_tokens + num_new != seq.num_tokens:
            return []
        return [ForkData(self.next_seq_id(), i, self.kv.fork_ring(seq, i - 1)) for i in range(1, seq.pending_forks + 1)]

    def complete(self, parent: Sequence, fork: ForkData) -> Sequence:
        """The sibling `fork` of `parent`, sharing its computed blocks (the workers created it too)."""
        child = Sequence(fork.seq_id, parent.request_id, fork.index, list(parent.prompt_token_ids), parent.params,
                         num_computed_tokens=parent.num_computed_tokens, end_token_ids=parent.end_token_ids)
        self.kv.share(parent, child, fork.ring_slot)
        child.known_to_workers, child.num_blocks_sent = True, len(child.block_tables[0])
        parent.pending_forks = 0
        return child
