"""The scheduler: one rule, bring each sequence's computed tokens up to its tokens, under a budget.

Each step it first continues running sequences (decodes, and prompts being prefilled in
chunks), oldest first, then admits waiting ones while the token budget
(`max_num_batched_tokens`), the sequence cap (`max_num_seqs`) and free KV blocks allow.
An admitted sequence first takes whatever prefix of it the prefix cache holds (its
computed count starts there). A prompt longer than the remaining budget is prefilled in
chunks over several steps. When a running sequence needs a block and none is free, the
newest running sequence is preempted: its blocks return to the pool and it goes back to
the front of the queue, to be recomputed later. A shared block that a sequence is about
to write into is copied first (copy-on-write). Blocks live in one pool per KV-cache group
(`KVCacheManager`): a sequence needs its new blocks in every group, and a sliding-window
group's blocks that no new token can see are released before each step.

Every step makes progress or says why not: a sequence that cannot fit in the whole pool even
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
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from turbollm.engine.kv_cache_manager import KVCacheManager
from turbollm.engine.runner_output import ModelRunnerOutput, PromptLogprobs, SampledToken
from turbollm.engine.scheduler_output import CachedRequestData, ForkData, NewRequestData, SchedulerOutput
from turbollm.engine.sequence import Sequence, SequenceStatus
from turbollm.spec_decode.adaptive import AdaptivePlanner
from turbollm.spec_decode.config import ROW_INVARIANT_ROWS
from turbollm.spec_decode.proposers import Proposer


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


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None, proposer: Proposer | None = None, num_spec_tokens: int = 0):
        self.kv, self.block_size = kv, kv.block_size
        # speculative decoding: drafts for eligible decodes (`_drafts`), verified by the workers
        self.proposer, self.num_spec_tokens = proposer, num_spec_tokens
        # verified steps, draft tokens proposed, drafts accepted (vLLM's spec_decode counters)
        self.spec_counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.spec_accepted_per_pos = [0] * num_spec_tokens  # drafts accepted at each position 0..K-1
        self.propose_seconds = 0.0  # time spent in the proposer (the benchmark's draft / verify split)
        self.planner: AdaptivePlanner | None = None  # adaptive speculation: drafts per sequence and step
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence by seq_id
        self.num_preemptions = 0
        self._seq_ids = itertools.count()
        self._finished_ids: list[int] = []  # finished since the last schedule and known to the workers
        self._resumed: set[int] = set()  # preempted, their tables cleared on the workers
        # (group, table position) of entries released out of a sliding window and not yet sent to the workers
        self._released: dict[int, list[tuple[int, int]]] = {}

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
        return bool(self.waiting or self.running)

    @property
    def num_seq_slots(self) -> int:
        """Sequence slots taken: every running sequence plus the siblings its prompt will fork."""
        return sum(1 + s.pending_forks for s in self.running)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self._released.pop(seq.seq_id, None)  # the workers clear its tables
        if self.proposer is not None:
            self.proposer.preempted(seq.seq_id)
        if seq.known_to_workers:
            out.preempted_seq_ids.append(seq.seq_id)
            self._resumed.add(seq.seq_id)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_seq_ids=self._finished_ids)
        self._finished_ids = []
        chosen: list[tuple[Sequence, int, list[tuple[int, int]]]] = []  # (sequence, new tokens, (group, table
        # position) of the entries replaced: copied on write, or released out of a sliding window)
        budget = self.max_num_batched_tokens
        drafts: dict[int, list[int]] = {}
        running = list(self.running)
        for seq in running:  # every running sequence returns the blocks its windows passed, scheduled or not
            released = self.kv.release_out_of_window(seq)
            if released:
                self._released.setdefault(seq.seq_id, []).extend(released)
        plan = self._plan(running) if self.proposer is not None and self.planner is not None else None
        for idx, seq in enumerate(running):
            if seq not in self.running or budget == 0:
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                continue
            k = 0
            if n == 1 and self.proposer is not None:
                # rows left for drafts: the tokens scheduled so far and one per running sequence after this one
                rows = self.max_num_batched_tokens - budget + (len(running) - idx - 1)
                k = self._draft_limit(seq, min(budget, ROW_INVARIANT_ROWS - rows) - 1)
                if plan is not None:
                    k = min(k, plan.get(seq.seq_id, 0))
                if k and not self.proposer.needs_blocks:
                    d = self._propose(seq, k)
                    k = 0
                    if d:
                        drafts[seq.seq_id] = d
                        n += len(d)
                else:  # blocks for k drafts first (k may be 0): the proposer writes their K/V
                    n += k
            replaced = self._released.pop(seq.seq_id, [])
            shared = self.kv.shared_write_block(seq)
            need = self.kv.blocks_needed(seq, n) + (shared is not None)
            if (k or seq.seq_id in drafts) and not self.kv.can_allocate(need):  # drafts preempt no one
                n, k = 1, 0
                drafts.pop(seq.seq_id, None)
                need = self.kv.blocks_needed(seq, n) + (shared is not None)
            while not self.kv.can_allocate(need) and self.running[-1] is not seq:
                self._preempt(self.running[-1], out)
            if not self.kv.can_allocate(need):
                drafts.pop(seq.seq_id, None)
                if self.running[0] is seq:  # alone, and still too big: it can never run
                    self._drop(seq, out)
                else:
                    self._preempt(seq, out)
                continue
            if shared is not None:
                for group, src, dst in self.kv.copy_on_write(seq, shared):
                    out.copy_blocks.append((group, src, dst))
                    replaced.append((group, shared))
            self.kv.grow(seq, n)
            if k:
                d = self._propose(seq, k)
                n -= k - len(d)  # the blocks of drafts not made stay with the sequence for its next tokens
                if d:
                    drafts[seq.seq_id] = d
            chosen.append((seq, n, replaced))
            budget -= n
        while self.waiting and budget > 0 and self.num_seq_slots + 1 + self.waiting[0].pending_forks <= self.max_num_seqs:
            seq = self.waiting[0]
            self.kv.take_cached_prefix(seq)
            self.kv.release_out_of_window(seq)  # a long cached prefix: its old blocks out of the windows
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.can_allocate(self.kv.blocks_needed(seq, n)):
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                if self.running:  # blocks come back as the running sequences finish
                    break
                self._drop(seq, out)  # the whole pool is free and still too small
                continue
            self.waiting.popleft()
            self.kv.count_admitted(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.kv.grow(seq, n)
            chosen.append((seq, n, []))
            budget -= n
        for seq, n, replaced in chosen:
            d = drafts.get(seq.seq_id)
            self._describe(seq, n - len(d) if d else n, replaced, out)
            if d:
                out.scheduled_token_ids[seq.seq_id] = out.scheduled_token_ids[seq.seq_id] + d
                out.spec_token_ids[seq.seq_id] = d
        self.kv.note_usage()
        if out.is_empty:  # nothing runs: the workers hear of the finished sequences next time
            self._finished_ids = out.finished_seq_ids + self._finished_ids
            out.finished_seq_ids = []
        return out

    def _describe(self, seq: Sequence, n: int, replaced: list[tuple[int, int]], out: SchedulerOutput) -> None:
        """Put what the workers need of `seq` for this step into `out` (only what they do not know)."""
        c, tables = seq.num_computed_tokens, seq.block_tables
        if not seq.known_to_workers:
            out.new_reqs.append(NewRequestData(seq.seq_id, seq.index, seq.all_token_ids, seq.num_prompt_tokens,
                                               seq.params, sorted(seq.end_token_ids),
                                               tuple(list(t) for t in tables), c))
            seq.known_to_workers = True
        else:
            sent = seq.num_blocks_sent
            changed = tuple([] for _ in tables)
            for group, i in replaced:
                if i < sent:
                    changed[group].append((i, tables[group][i]))
            out.cached_reqs.append(CachedRequestData(
                seq.seq_id, tuple(t[sent:] for t in tables), c, seq.seq_id in self._resumed,
                changed if replaced else (), seq.pending_evictions))
            self._resumed.discard(seq.seq_id)
            seq.pending_evictions = []
        seq.num_blocks_sent = len(tables[0])
        out.scheduled_token_ids[seq.seq_id] = seq.token_slice(c, c + n)
        if c + n == seq.num_tokens and seq.pending_forks:
            out.forks[seq.seq_id] = [ForkData(self.next_seq_id(), i) for i in range(1, seq.pending_forks + 1)]

    def _plan(self, running: list[Sequence]) -> dict[int, int]:
        """Adaptive speculation: drafts per decode for this step (`AdaptivePlanner`), for a step whose rows
        without drafts are every running sequence's tokens still to compute (within the budget)."""
        base = min(sum(s.num_tokens - s.num_computed_tokens for s in running), self.max_num_batched_tokens)
        limits = {s.seq_id: self._draft_limit(s, ROW_INVARIANT_ROWS - base) for s in running
                  if s.num_tokens - s.num_computed_tokens == 1}
        return self.planner.plan(limits, base)

    def observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """A step's measured time, for the adaptive cost model (decode and verification steps only)."""
        if self.planner is None or sched.new_reqs:
            return
        spec = sched.spec_token_ids
        if all(len(t) - len(spec.get(sid, ())) == 1 for sid, t in sched.scheduled_token_ids.items()):
            self.planner.costs.observe(sum(map(len, sched.scheduled_token_ids.values())), seconds)

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        t0 = time.perf_counter()
        drafts: list[int] = []
        try:
            drafts = self.proposer.propose(seq.seq_id, seq.all_token_ids, k)
            return drafts
        finally:
            seconds = time.perf_counter() - t0
            self.propose_seconds += seconds
            if self.planner is not None:
                own = self.proposer.seconds_per_draft  # a draft model: its one-token steps (no catch-up)
                if own is not None:
                    self.planner.costs.draft_seconds = own
                else:
                    self.planner.costs.observe_draft(len(drafts), seconds)

    def _draft_limit(self, seq: Sequence, room: int) -> int:
        """How many draft tokens a decode of `seq` may verify this step: any sampling settings speculate
        (the workers verify each row with its own history, `ModelRunner._verify`), but not a prompt that
        still has n > 1 siblings to fork, and never past max_tokens, the context, the step's token budget
        or, with the tokens scheduled before them, `ROW_INVARIANT_ROWS` (`room` says how many fit)."""
        p = seq.params
        if seq.pending_forks:
            return 0
        k = min(self.num_spec_tokens, room)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - len(seq.output_token_ids) - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - seq.num_tokens - 1)
        return max(k, 0)

    def finish_scratch(self, seq_id: int) -> None:
        """A sequence the engine ran on the workers outside the scheduler (a profile): they drop it next step."""
        self._finished_ids.append(seq_id)

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
        self.kv.free(seq)
        self._released.pop(seq.seq_id, None)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted, or failed) sequence and return its blocks."""
        self._dequeue(seq)
        seq.status = SequenceStatus.FINISHED
        if self.proposer is not None and seq.seq_id in self.seqs:
            self.proposer.finish(seq.seq_id, seq.output_token_ids)
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
        for sid, tokens in sched.scheduled_token_ids.items():
            seq = self.seqs.get(sid)
            if seq is not None and sid not in sched.spec_token_ids:
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
                child = self._fork(parent, f)
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
                self.spec_counts["num_drafts"] += 1
                self.spec_counts["num_draft_tokens"] += len(sched.spec_token_ids[sid])
                self.spec_counts["num_accepted_tokens"] += len(sampled) - 1
                if self.planner is not None:
                    self.planner.record(sid, len(sched.spec_token_ids[sid]), len(sampled) - 1)
                for pos in range(len(sampled) - 1):
                    self.spec_accepted_per_pos[pos] += 1
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

    def _fork(self, parent: Sequence, fork: ForkData) -> Sequence:
        """A sibling of `parent` (n > 1) sharing its computed blocks; the workers created it too."""
        child = Sequence(fork.seq_id, parent.request_id, fork.index, list(parent.prompt_token_ids), parent.params,
                         num_computed_tokens=parent.num_computed_tokens, end_token_ids=parent.end_token_ids)
        self.kv.share(parent, child)
        child.known_to_workers, child.num_blocks_sent = True, len(child.block_tables[0])
        self.add_running(child)
        parent.pending_forks = 0
        return child

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
