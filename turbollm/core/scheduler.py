"""The scheduler: one rule, bring each sequence's computed tokens up to its tokens, under a budget.

Each step it first continues running sequences (decodes, and prompts being prefilled in
chunks), oldest first, then admits waiting ones while the token budget
(`max_num_batched_tokens`), the sequence cap (`max_num_seqs`) and free KV blocks allow.
An admitted sequence first takes whatever prefix of it the prefix cache holds (its
computed count starts there). A prompt longer than the remaining budget is prefilled in
chunks over several steps. When a running sequence needs a block and none is free, the
newest running sequence (not in a step still in flight) is preempted: its blocks return to the pool and it goes back to
the front of the queue, to be recomputed later. A shared block that a sequence is about
to write into is copied first (copy-on-write). Blocks live in one pool per KV-cache group
(`KVCacheManager`): a sequence needs its new blocks in every group, and a sliding-window
group's blocks that no new token can see are released before each step.

Every step makes progress or says why not (with steps in flight a step may be empty while the ones out
hold what it needs; the engine then takes one back first): a sequence that cannot fit in the whole pool even
with nothing else running (which the engine's cap of `max_model_len` to the pool rules out, so
this is a last line of defence) is taken out and reported in `SchedulerOutput.unschedulable_seq_ids`
instead of preempting itself forever. An n > 1 request's siblings-to-be (`pending_forks`)
take their `max_num_seqs` slots when the prompt is admitted.

`schedule()` returns plain data (`scheduler_output.py`): what the workers do not know yet of
each scheduled sequence, and the token ids each computes. `update_from_output()` takes the
workers' sampled tokens back: it advances the counters, indexes newly full blocks in the prefix
cache, forks n > 1 siblings off a prompt at its first sample, passes the attention scores of an
eviction policy to the KV-cache manager (which may evict blocks), and applies the token-level stop
rules (end tokens after `min_tokens`, `max_tokens`, the context); stop strings, which need the
text, are the output processor's. Blocks and the prefix cache are `KVCacheManager`'s.

Steps in flight (pipeline stages, `max_steps_in_flight` = P): the engine may ask for step k + 1 before
step k's tokens are back. A sequence in a step still in flight (`in_flight`) is neither scheduled nor
preempted until `update_from_output` (or `returned`, for a step that failed) takes the step back, and a
step takes at most 1/P of the sequences that can run at once (`max_num_seqs`), so the P steps in flight
share them. A sequence whose blocks are held by newer sequences in flight ends the step where it is
(no preemption, no admission) and takes them once those steps are back. A block freed
while a step that used it is in flight (an aborted request) may go to a later step at once: every
stage runs the steps in order, so the later step's writes come after the earlier one's.
The speculative-decoding side (room for drafts, verifying the drafts the workers proposed, the adaptive
planner) is `scheduler_spec.py`'s; the proposers run on the worker side. A KV connector's loads (a sequence
whose prefix blocks come from outside waits one step for them) are `scheduler_kv_transfer.py`'s.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from turbollm.core.forking import Forking
from turbollm.core.kv_cache_manager import KVCacheManager
from turbollm.core.scheduler_kv_transfer import KVTransferScheduling
from turbollm.core.scheduler_spec import SpeculationPlanning
from turbollm.core.sequence import Sequence, SequenceStatus
from turbollm.handoff.runner_output import ModelRunnerOutput, PromptLogprobs, SampledToken
from turbollm.handoff.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from turbollm.kernels.limits import ROW_INVARIANT_ROWS


@dataclass
class SeqUpdate:
    """What one step did to one sequence (engine side: it holds the live `Sequence`)."""

    seq: Sequence
    tokens: list[SampledToken] = field(default_factory=list)  # appended this step
    prompt_logprobs: PromptLogprobs | None = None
    forked: bool = False  # a sibling created this step


@dataclass
class SchedulerUpdate:
    updates: list[SeqUpdate] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # sampling raised for these


@dataclass
class _Step:
    """A step being put together: what goes to the workers, the token budget left, the sequences taken with their
    new tokens (drafts included) and the (group, table position) of the entries replaced in their tables
    (copied on write, or released out of a sliding window), and the drafts each decode verifies."""

    out: SchedulerOutput
    budget: int
    per_step: int  # the most sequences it takes
    chosen: list[tuple[Sequence, int, list[tuple[int, int]]]] = field(default_factory=list)
    drafts: dict[int, list[int]] = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return self.budget <= 0 or len(self.chosen) >= self.per_step

    def take(self, seq: Sequence, n: int, replaced: list[tuple[int, int]]) -> None:
        self.chosen.append((seq, n, replaced))
        self.budget -= n


class Scheduler(SpeculationPlanning, KVTransferScheduling):
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None, num_spec_tokens: int = 0, drafts_write_kv: bool = False):
        self.kv, self.block_size = kv, kv.block_size
        self._init_speculation(num_spec_tokens, drafts_write_kv)
        self._init_kv_transfer()  # a KV connector's loads (core/scheduler_kv_transfer.py)
        self.forking = Forking(kv, self.next_seq_id)  # n > 1 siblings
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence by seq_id
        self.num_preemptions = 0
        self._seq_ids = itertools.count()
        self._finished_ids: list[int] = []  # finished since the last schedule and known to the workers
        self._preempted_ids: list[int] = []  # preempted in a step that did not run: the workers hear of it next
        self._resumed: set[int] = set()  # preempted, their tables cleared on the workers
        # (group, table position) of entries released out of a sliding window and not yet sent to the workers
        self._released: dict[int, list[tuple[int, int]]] = {}
        # steps handed out before the previous ones are back (pipeline stages: `max_steps_in_flight` = stages):
        # a sequence in a step not yet back is not scheduled or preempted, and a step takes about
        # 1 / max_steps_in_flight of the sequences that can run at once, so that the steps in flight share them
        self.max_steps_in_flight = 1
        self.in_flight: set[int] = set()

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.seqs[seq.seq_id] = seq

    def add_running(self, seq: Sequence) -> None:
        """Add a sequence that already holds blocks (a forked sibling) straight to the running set."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.seqs[seq.seq_id] = seq

    def has_unfinished(self) -> bool:
        """Requests to serve, or a KV connector's work for the workers (blocks to save, a bundle to leave)."""
        return bool(self.waiting or self.running or self.loading) or bool(self.kv.connector and self.kv.connector.busy)

    @property
    def num_seq_slots(self) -> int:
        """Sequence slots taken: every running (or loading) sequence plus the siblings its prompt will fork."""
        return sum(self.forking.slots(s) for s in self.running) + sum(self.forking.slots(s)
                                                                       for s, _ in self.loading.values())

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self._released.pop(seq.seq_id, None)  # the workers clear its tables
        seq.spec_token_ids = []
        if seq.known_to_workers:
            out.preempted_seq_ids.append(seq.seq_id)
            self._resumed.add(seq.seq_id)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_seq_ids=self._finished_ids, preempted_seq_ids=self._preempted_ids)
        self._finished_ids, self._preempted_ids = [], []
        if self.kv.connector is not None:
            self.kv.connector.poll()  # (a p2p producer frees the blocks a decode instance has copied)
        running = [s for s in self.running if s.seq_id not in self.in_flight]
        # sequences a step takes: its share of those that can run at once
        per_step = -(-min(len(self.running) + len(self.waiting), self.max_num_seqs) // self.max_steps_in_flight)
        step = _Step(out, self.max_num_batched_tokens, per_step)
        for seq in running:  # every running sequence returns the blocks its windows passed, scheduled or not
            released = self.kv.release_out_of_window(seq)
            if released:
                self._released.setdefault(seq.seq_id, []).extend(released)
        plan = self._plan(running) if self.speculates else None
        held_back = False  # a sequence waits for blocks held in steps in flight: no admission either
        for idx, seq in enumerate(running):
            if seq in self.running and not step.full and not self._continue(seq, step, len(running) - idx - 1):
                held_back = True
                break
        if not held_back:
            self._admit(step)
        for seq, n, replaced in step.chosen:
            d = step.drafts.get(seq.seq_id, [])
            if self.speculates:
                self._reserve_room(seq, n, len(d), plan, out)
            self._describe(seq, n - len(d), replaced, out)
            if d:
                out.scheduled_token_ids[seq.seq_id] = out.scheduled_token_ids[seq.seq_id] + d
                out.spec_token_ids[seq.seq_id] = d
        if self.kv.connector is not None:
            out.kv_transfer = self.kv.connector.take_meta()
        self.kv.note_usage()
        self.in_flight.update(out.scheduled_token_ids)
        if out.is_empty:  # nothing runs: the workers hear of the finished and preempted sequences next time
            self._finished_ids = out.finished_seq_ids + self._finished_ids
            self._preempted_ids = out.preempted_seq_ids + self._preempted_ids
            out.finished_seq_ids, out.preempted_seq_ids = [], []
        return out

    def _continue(self, seq: Sequence, step: "_Step", num_after: int) -> bool:
        """Put running `seq`'s next tokens (and the drafts it verifies) into `step`, preempting newer sequences for
        blocks if need be; False when it must wait for blocks held by steps in flight (the step ends there).
        `num_after`: running sequences after it (a row each, for the drafts' row limit)."""
        n = self._chunk(seq, step.budget)
        if n <= 0:
            return True
        if n == 1 and seq.spec_token_ids:
            # rows left for drafts: the tokens scheduled so far and one per running sequence after this one
            rows = self.max_num_batched_tokens - step.budget + num_after
            d = seq.spec_token_ids[:self._draft_limit(seq, min(step.budget, ROW_INVARIANT_ROWS - rows) - 1)]
            if d:
                step.drafts[seq.seq_id] = d
                n += len(d)
        replaced = self._released.pop(seq.seq_id, [])
        shared = self.kv.shared_write_block(seq)
        need = self.kv.blocks_needed(seq, n) + (shared is not None)
        if seq.seq_id in step.drafts and not self.kv.can_allocate(need):  # drafts preempt no one
            n = 1
            step.drafts.pop(seq.seq_id)
            need = self.kv.blocks_needed(seq, n) + (shared is not None)
        if not self.kv.can_allocate(need) and self._newer_in_flight(seq):
            # newer sequences hold blocks in steps still out: the step ends here (no preemption, no newer
            # sequence, no admission: the blocks stay for it), and it takes them once those steps are back
            step.drafts.pop(seq.seq_id, None)
            if replaced:
                self._released[seq.seq_id] = replaced + self._released.get(seq.seq_id, [])
            return False
        # (no newer sequence is in flight here: each may be preempted)
        while not self.kv.can_allocate(need) and self.running[-1] is not seq:
            self._preempt(self.running[-1], step.out)
        if not self.kv.can_allocate(need):
            step.drafts.pop(seq.seq_id, None)
            if self.running[0] is seq:  # alone, and still too big: it can never run
                self._drop(seq, step.out)
            else:
                self._preempt(seq, step.out)
            return True
        if shared is not None:
            for group, src, dst in self.kv.copy_on_write(seq, shared):
                step.out.copy_blocks.append((group, src, dst))
                replaced.append((group, shared))
        self.kv.grow(seq, n)
        step.take(seq, n, replaced)
        return True

    def _admit(self, step: "_Step") -> None:
        """Admit waiting sequences, oldest first, while the step's budget, the sequence cap and free blocks allow
        (each first takes what the prefix cache holds of it)."""
        while self.waiting and not step.full \
                and self.num_seq_slots + self.forking.slots(self.waiting[0]) <= self.max_num_seqs:
            seq = self.waiting[0]
            # its prefix cache hit; a KV connector's blocks (a prefill instance's, the block store's) load first
            if self._start_remote_load(seq) or self._take_prefix(seq):
                continue
            self.kv.release_out_of_window(seq)  # a long cached prefix: its old blocks out of the windows
            n = self._chunk(seq, step.budget)
            # (a quantized format: the float16 rings of recent tokens, its own and its siblings'-to-be, first)
            if not self.kv.take_rings(seq) or not self.kv.can_allocate(self.kv.blocks_needed(seq, n)):
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                if self.running:  # blocks come back as the running sequences finish
                    break
                self._drop(seq, step.out)  # the whole pool is free and still too small
                continue
            self.waiting.popleft()
            self.kv.count_admitted(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.kv.grow(seq, n)
            step.take(seq, n, [])

    def _newer_in_flight(self, seq: Sequence) -> bool:
        """Whether a running sequence newer than `seq` is in a step still in flight (not to be preempted)."""
        newer = self.running[self.running.index(seq) + 1:]
        return any(other.seq_id in self.in_flight for other in newer)

    def returned(self, sched: SchedulerOutput) -> None:
        """A step handed out is back (or failed): its sequences may be scheduled again."""
        self.in_flight.difference_update(sched.scheduled_token_ids)

    def _describe(self, seq: Sequence, n: int, replaced: list[tuple[int, int]], out: SchedulerOutput) -> None:
        """Put what the workers need of `seq` for this step into `out` (only what they do not know)."""
        c, tables = seq.num_computed_tokens, seq.block_tables
        if not seq.known_to_workers:
            out.new_reqs.append(NewRequestData(seq.seq_id, seq.index, seq.all_token_ids, seq.num_prompt_tokens,
                                               seq.params, sorted(seq.end_token_ids),
                                               tuple(list(t) for t in tables), c, self.kv.ring_of.get(seq.seq_id, -1)))
            seq.known_to_workers = True
        else:
            sent = seq.num_blocks_sent
            changed = tuple([] for _ in tables)
            for group, i in replaced:
                if i < sent:
                    changed[group].append((i, tables[group][i]))
            out.cached_reqs.append(CachedRequestData(
                seq.seq_id, tuple(t[sent:] for t in tables), c, seq.seq_id in self._resumed,
                changed if replaced else (), seq.pending_evictions,
                self.kv.ring_of.get(seq.seq_id, -1) if seq.seq_id in self._resumed else -1))
            self._resumed.discard(seq.seq_id)
            seq.pending_evictions = []
        seq.num_blocks_sent = len(tables[0])
        out.scheduled_token_ids[seq.seq_id] = seq.token_slice(c, c + n)
        forks = self.forking.plan(seq, n)
        if forks:
            out.forks[seq.seq_id] = forks

    def _drop(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take out a sequence that cannot fit in the whole pool; the engine ends it with an error."""
        self._dequeue(seq)
        seq.num_computed_tokens = 0
        out.unschedulable_seq_ids.append(seq.seq_id)

    def _dequeue(self, seq: Sequence) -> None:
        """Take `seq` out of the running or waiting queue and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self._forget_load(seq)
        self.kv.free(seq)
        self._released.pop(seq.seq_id, None)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted, or failed) sequence and return its blocks."""
        if self.kv.connector is not None:
            self.kv.connector.request_finished(seq, self.kv.ring_of.get(seq.seq_id, -1))  # (a producer's hand-off)
        self._dequeue(seq)
        seq.status = SequenceStatus.FINISHED
        if self.planner is not None:
            self.planner.forget(seq.seq_id)
        self.seqs.pop(seq.seq_id, None)
        self._resumed.discard(seq.seq_id)
        if seq.known_to_workers:
            self._finished_ids.append(seq.seq_id)

    # ---------------------------------------------------------------- update
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> SchedulerUpdate:
        """Apply a step's results: counters, prefix-cache blocks, forks, new tokens and their stop rules."""
        result = SchedulerUpdate()
        updates: dict[int, SeqUpdate] = {}
        self.returned(sched)
        self._loads_done(sched, out)
        for sid, tokens in sched.scheduled_token_ids.items():
            seq = self.seqs.get(sid)
            if seq is not None:
                if self.speculates:
                    seq.spec_token_ids = out.draft_token_ids.get(sid, [])
                if sid not in sched.spec_token_ids:
                    seq.num_computed_tokens += len(tokens)
                    self.kv.cache_computed_blocks(seq)
        for sid, plp in out.prompt_logprobs.items():
            if sid in self.seqs:
                updates.setdefault(sid, SeqUpdate(self.seqs[sid])).prompt_logprobs = plp
        for parent_id, forks in sched.forks.items():
            parent = self.seqs.get(parent_id)
            if parent is None or parent_id not in out.sampled:
                # no fork after all (the parent's sample failed): the workers drop the siblings they made
                self._finished_ids.extend(f.seq_id for f in forks)
                continue
            for f in forks:
                child = self.forking.complete(parent, f)
                self.add_running(child)
                updates[child.seq_id] = SeqUpdate(child, forked=True)
        for sid, error in out.errors.items():  # after the forks: a sibling's own sample can fail too
            if sid in self.seqs:
                result.failed.append((self.seqs[sid], error))
        for sid, sampled in out.sampled.items():
            seq = self.seqs.get(sid)
            if seq is None:
                continue
            update = updates.setdefault(sid, SeqUpdate(seq))
            if sid in sched.spec_token_ids:
                # a verified step: its last token and the accepted drafts now have K/V (the final
                # sampled token does not yet); rejected drafts' slots are rewritten later
                seq.num_computed_tokens += len(sampled)
                self._record_verified(seq, len(sched.spec_token_ids[sid]), len(sampled) - 1)
            for token in sampled:
                seq.output_token_ids.append(token.token_id)
                update.tokens.append(token)
                if self._check_stop(seq, token.token_id):
                    self.finish(seq)
                    break
            if sid in sched.spec_token_ids and not seq.is_finished:
                self.kv.cache_computed_blocks(seq)
        for sid, (rows, mass) in out.kv_scores.items():  # attention-score eviction, once the counters moved
            # (siblings forked this step share the sequence's table and scores, and then evict on their own)
            for seq in [self.seqs.get(sid)] + [self.seqs.get(f.seq_id) for f in sched.forks.get(sid, ())]:
                if seq is not None and seq.block_tables:
                    self.kv.observe_scores(seq, rows, mass)
                    seq.pending_evictions.extend(self.kv.evict(seq))
        result.updates = list(updates.values())
        return result

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Set the finish reason when `token` ends `seq`: an end token (after min_tokens), max_tokens, the context."""
        p, n_out = seq.params, len(seq.output_token_ids)
        if token in seq.end_token_ids and n_out >= p.min_tokens:
            seq.finish_reason, seq.stop_reason = "stop", (token if token in (p.stop_token_ids or ()) else None)
            return True
        limit = self.max_model_len if self.max_model_len is not None else float("inf")
        max_tokens = p.max_tokens if p.max_tokens is not None else limit
        if n_out >= max_tokens or seq.num_tokens >= limit:
            seq.finish_reason, seq.stop_reason = "length", None
            return True
        return False
