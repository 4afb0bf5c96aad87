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

A decode instance's sequence (prefill/decode hand-off, `remote_prefill`) is parked the same way, with fresh
blocks for the part of its prompt its own prefix cache lacks (`take_remote_prefix`) and a ring slot for a
quantized format, while its worker loads the producer's bundle; a bundle not there yet keeps it parked
another step (until its deadline). Once loaded it runs on, holding its blocks, from the producer's first
token; after a failure it prefills itself — its prompt alone first (`_chunk`), so the bits stay the same.
"""

from __future__ import annotations

from turbollm.core.sequence import Sequence, SequenceStatus
from turbollm.handoff.kv_transfer import KVBlockRef, KVRemoteLoad, token_digest
from turbollm.handoff.runner_output import ModelRunnerOutput
from turbollm.handoff.scheduler_output import SchedulerOutput
from turbollm.log import init_logger

logger = init_logger()


class KVTransferScheduling:
    """Mixed into `Scheduler` (which holds `kv`, `waiting`, `running`)."""

    def _init_kv_transfer(self) -> None:
        # seq_id -> (sequence, its block loads; None: its prompt from a producer's bundle)
        self.loading: dict[int, tuple[Sequence, list[KVBlockRef] | None]] = {}
        self._remote: dict[int, KVRemoteLoad] = {}  # seq_id -> the remote load it waits for

    def _start_remote_load(self, seq: Sequence) -> bool:
        """A consumer's sequence (the queue's first) whose prompt K/V a producer left: take blocks for them and wait
        for the bundle (True); False when it prefills itself (no bundle for it, another prompt length, no room)."""
        conn = self.kv.connector
        remote = conn.remote_prefill(seq) if conn is not None and not seq.external_failed else None
        if remote is None:
            return False
        path, n, deadline, url = remote
        if n != seq.num_prompt_tokens:
            logger.warning("kv p2p: request %s: the bundle holds %d tokens, the prompt has %d; prefilled here",
                           seq.request_id, n, seq.num_prompt_tokens)
            self._remote_failed(seq, path)
            return False
        positions = self.kv.take_remote_prefix(seq, n)
        if positions is None:
            return False
        if not self.kv.take_rings(seq):  # (a quantized format: the ring of recent tokens travels too)
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            return False
        if self.kv.enable_caching:  # the prompt's start from this engine's own prefix cache: counted as a hit
            self.kv.stats.queries += seq.num_prompt_tokens
            self.kv.stats.hits += seq.num_cached_blocks * self.block_size
        self.waiting.popleft()
        self.loading[seq.seq_id] = (seq, None)
        self._remote[seq.seq_id] = load = KVRemoteLoad(seq.seq_id, path, positions, n,
                                                       token_digest(seq.token_slice(0, n)), deadline,
                                                       self.kv.ring_of.get(seq.seq_id, -1), url)
        conn.remote_loads.append(load)
        return True

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> int:
        """Tokens `seq` computes next under `budget`. A decode instance's request that prefills itself (its bundle
        failed) holds the prefill instance's first token: its prompt is computed alone first and that token in a
        step of its own, as the prefill instance and then a decode step did, so the output stays the same bits."""
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if seq.external_failed and seq.num_computed_tokens < seq.num_prompt_tokens:
            n = min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
        return n

    def _remote_failed(self, seq: Sequence, path: str) -> None:
        seq.external_failed = True
        self.kv.connector.stats["kv_remote_fallbacks"] += 1
        self.kv.connector.forget_bundle(path)

    def _take_prefix(self, seq: Sequence) -> bool:
        """`seq` (the queue's first) takes its prefix-cache hit; True when blocks of it must be loaded first (then it
        waits for them, parked)."""
        refs = self.kv.take_cached_prefix(seq)
        if refs:
            self._park_for_load(seq, refs)
        return bool(refs)

    def _park_for_load(self, seq: Sequence, refs: list[KVBlockRef]) -> None:
        """`seq` (the queue's first) waits for its loads; the workers do them in this step."""
        self.waiting.popleft()
        self.loading[seq.seq_id] = (seq, refs)
        self.kv.connector.load(seq.seq_id, refs, seq.num_computed_tokens - seq.num_cached_blocks * self.block_size)

    def _loads_done(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        if self.kv.connector is None:
            return
        self.kv.connector.step_done(sched.kv_transfer)
        self._remote_loads_done(sched, out)
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

    def _remote_loads_done(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """A consumer's prompt arrived whole: it runs on from there (its full blocks enter the prefix cache); or the
        bundle is not there yet: it waits another step; or it failed: the sequence prefills itself."""
        waiting = set(out.kv_waiting)
        for load in reversed(sched.kv_transfer.remote_loads):
            seq, _ = self.loading.get(load.seq_id, (None, None))
            if seq is None:  # aborted meanwhile
                continue
            if load.seq_id in waiting:
                self.kv.connector.remote_loads.append(load)
                continue
            del self.loading[load.seq_id]
            self._remote.pop(load.seq_id, None)
            if out.kv_loaded.get(load.seq_id, False):  # (not a prefix-cache hit: no count_admitted)
                self.kv.cache_computed_blocks(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            else:
                self._remote_failed(seq, load.path)
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                self.waiting.appendleft(seq)

    def _forget_load(self, seq: Sequence) -> None:
        """`seq` ends while its blocks are being loaded (the caller frees them)."""
        self.loading.pop(seq.seq_id, None)
        load = self._remote.pop(seq.seq_id, None)
        if load is not None:  # (a load waiting for its bundle is asked again each step: not any more)
            conn = self.kv.connector
            conn.remote_loads = [r for r in conn.remote_loads if r.seq_id != seq.seq_id]
            conn.forget_bundle(load.path)
