"""The scheduler's KV-connector part: a sequence whose prefix blocks are loaded from outside waits one step.

At admission the KV-cache manager takes the prefix the pools hold and, from the connector, the blocks
the outside holds beyond it (`take_cached_prefix` returns them as loads into fresh blocks). Such a
sequence is parked (`loading`, holding its slot and blocks) instead of running: the step carries the
loads (`SchedulerOutput.kv_transfer`), the worker's connector does them before the forward pass, and
`update_from_output` hears which sequences got all their blocks whole. Either way the sequence's blocks
go back to the pool and it returns to the front of the queue: after a good load its loaded blocks are in
the prefix cache, so it takes them at once as an ordinary hit; after a failed one (a block missing,
short, corrupt, or of another key) they were never indexed, and the sequence computes its prefix
itself (`external_failed`: it asks the outside no more) — the output is the same either way.
"""

from __future__ import annotations

from turbollm.core.sequence import Sequence
from turbollm.handoff.kv_transfer import KVBlockRef
from turbollm.handoff.runner_output import ModelRunnerOutput
from turbollm.handoff.scheduler_output import SchedulerOutput


class KVTransferScheduling:
    """Mixed into `Scheduler` (which holds `kv`, `waiting`)."""

    def _init_kv_transfer(self) -> None:
        self.loading: dict[int, tuple[Sequence, list[KVBlockRef]]] = {}  # seq_id -> (sequence, its loads)

    def _park_for_load(self, seq: Sequence, refs: list[KVBlockRef]) -> None:
        """`seq` (the queue's first) waits for its loads; the workers do them in this step."""
        self.waiting.popleft()
        self.loading[seq.seq_id] = (seq, refs)
        self.kv.connector.load(seq.seq_id, refs, seq.num_computed_tokens - seq.num_cached_blocks * self.block_size)

    def _loads_done(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        if self.kv.connector is None:
            return
        failed = 0
        for load in reversed(sched.kv_transfer.loads):  # (back to the queue's front in their order)
            seq, refs = self.loading.pop(load.seq_id, (None, None))
            if seq is None:  # aborted meanwhile: its blocks were freed then
                continue
            if out.kv_loaded.get(load.seq_id, False):
                self.kv.cache_loaded_blocks(refs)
            else:
                seq.external_failed = True
                self.kv.connector.load_failed(refs)
                failed += 1
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            self.waiting.appendleft(seq)
        self.kv.connector.observe(out.kv_stats, failed)

    def _forget_load(self, seq: Sequence) -> None:
        """`seq` ends while its blocks are being loaded (the caller frees them)."""
        self.loading.pop(seq.seq_id, None)
