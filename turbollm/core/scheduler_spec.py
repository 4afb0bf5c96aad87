"""The scheduler's side of speculative decoding (`Scheduler` inherits it). The proposers run on the worker
side (worker/drafter.py) after each step, on the tokens it sampled; the scheduler only

- reserves room: how many drafts the workers may propose for a sequence after a step
  (`SchedulerOutput.draft_room`, `_room`) and, when the proposer writes K/V (a draft model), the blocks
  for them (`_reserve_room`);
- verifies what came back: the drafts a sequence got (`Sequence.spec_token_ids`) go into its next step,
  cut to what the step may verify (`_draft_limit`: max_tokens, the context, the token budget and
  `ROW_INVARIANT_ROWS`);
- plans: the adaptive planner's drafts per sequence (`_plan`) and its cost model, fed by the steps' times and
  the workers' proposing times (`observe_step`).
"""

from __future__ import annotations

from turbollm.core.sequence import Sequence
from turbollm.handoff.runner_output import ModelRunnerOutput
from turbollm.handoff.scheduler_output import SchedulerOutput
from turbollm.kernels.limits import ROW_INVARIANT_ROWS
from turbollm.spec_decode.adaptive import AdaptivePlanner


class SpeculationPlanning:
    max_num_batched_tokens: int
    max_model_len: int | None
    kv: object  # KVCacheManager

    def _init_speculation(self, num_spec_tokens: int, drafts_write_kv: bool) -> None:
        # K: drafts per sequence and step at most (0: no speculation); whether the proposer writes the
        # drafts' K/V into the sequence's blocks (a draft model: the blocks are reserved with the room)
        self.num_spec_tokens, self.drafts_write_kv = num_spec_tokens, drafts_write_kv
        # verified steps, draft tokens proposed, drafts accepted (vLLM's spec_decode counters)
        self.spec_counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.spec_accepted_per_pos = [0] * num_spec_tokens  # drafts accepted at each position 0..K-1
        self.propose_seconds = 0.0  # the workers' time in the proposer (the benchmark's draft / verify split)
        self.planner: AdaptivePlanner | None = None  # adaptive speculation: drafts per sequence and step

    @property
    def speculates(self) -> bool:
        return self.num_spec_tokens > 0

    def _plan(self, running: list[Sequence]) -> dict[int, int] | None:
        """Adaptive speculation: drafts per decode (`AdaptivePlanner`), for a step whose rows without drafts
        are every running sequence's tokens still to compute (within the budget); None without a planner."""
        if self.planner is None:
            return None
        base = min(sum(s.num_tokens - s.num_computed_tokens for s in running), self.max_num_batched_tokens)
        limits = {s.seq_id: self._draft_limit(s, ROW_INVARIANT_ROWS - base) for s in running
                  if s.num_tokens - s.num_computed_tokens == 1}
        return self.planner.plan(limits, base)

    def _room(self, seq: Sequence, plan: dict[int, int] | None) -> int:
        """Drafts the workers may propose for `seq` after a step in which it samples: K, or the planner's
        number, never past what its next step could verify (it holds at least one token more by then; its
        siblings-to-be, if any, draft from their own next step)."""
        k = self.num_spec_tokens if plan is None else plan.get(seq.seq_id, self.num_spec_tokens)
        return self._draft_limit(seq, k, ahead=1)

    def _reserve_room(self, seq: Sequence, n: int, num_drafts: int, plan: dict[int, int] | None,
                      out: SchedulerOutput) -> None:
        """After `seq`'s `n` tokens are placed (`num_drafts` of them drafts it verifies): its room for drafts,
        when this step samples it (its blocks too when the proposer writes K/V: drafts preempt no one, so no
        free blocks, no room)."""
        if seq.num_computed_tokens + n - num_drafts != seq.num_tokens:
            return
        room = self._room(seq, plan)
        if room and self.drafts_write_kv:
            if self.kv.can_allocate(self.kv.blocks_needed(seq, n + room)):
                self.kv.grow(seq, n + room)
            else:
                room = 0
        if room:
            out.draft_room[seq.seq_id] = room

    def _draft_limit(self, seq: Sequence, room: int, ahead: int = 0) -> int:
        """How many draft tokens a decode of `seq` may verify this step: any sampling settings speculate
        (the workers verify each row with its own history, worker/rejection.py), but not a prompt that still
        has n > 1 siblings to fork, and never past max_tokens, the context, the step's token budget or, with
        the tokens scheduled before them, `ROW_INVARIANT_ROWS` (`room` says how many fit). `ahead`: tokens
        `seq` will have gained by the step in question (1: the step after this one)."""
        p = seq.params
        if seq.pending_forks:
            return 0
        k = min(self.num_spec_tokens, room)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - len(seq.output_token_ids) - 1 - ahead)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - seq.num_tokens - 1 - ahead)
        return max(k, 0)

    def observe_step(self, sched: SchedulerOutput, out: ModelRunnerOutput, seconds: float) -> None:
        """A step's measured time, for the adaptive cost model (decode and verification steps only, less the
        time the workers spent proposing), and the proposer's own cost."""
        self.propose_seconds += out.propose_seconds
        if self.planner is None:
            return
        costs = self.planner.costs
        if out.seconds_per_draft is not None:
            costs.draft_seconds = out.seconds_per_draft
        elif out.draft_token_ids:
            costs.observe_draft(sum(map(len, out.draft_token_ids.values())), out.propose_seconds)
        if sched.new_reqs:
            return
        spec = sched.spec_token_ids
        if all(len(t) - len(spec.get(sid, ())) == 1 for sid, t in sched.scheduled_token_ids.items()):
            costs.observe(sum(map(len, sched.scheduled_token_ids.values())), seconds - out.propose_seconds)

    def _record_verified(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        self.spec_counts["num_drafts"] += 1
        self.spec_counts["num_draft_tokens"] += num_drafts
        self.spec_counts["num_accepted_tokens"] += num_accepted
        if self.planner is not None:
            self.planner.record(seq.seq_id, num_drafts, num_accepted)
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1
