"""The scheduler's side of speculative decoding (`Scheduler` inherits it): how many drafts a decode may
verify (`_draft_limit`), the adaptive planner's drafts per sequence and its cost model (`_plan`,
`observe_step`), and the proposer's calls, timed (`_propose`)."""

from __future__ import annotations

import time

from turbollm.core.sequence import Sequence
from turbollm.handoff.scheduler_output import SchedulerOutput
from turbollm.spec_decode.adaptive import AdaptivePlanner
from turbollm.spec_decode.config import ROW_INVARIANT_ROWS
from turbollm.spec_decode.proposers import Proposer


class SpeculationPlanning:
    max_num_batched_tokens: int
    max_model_len: int | None

    def _init_speculation(self, proposer: Proposer | None, num_spec_tokens: int) -> None:
        # speculative decoding: drafts for eligible decodes (`_drafts`), verified by the workers
        self.proposer, self.num_spec_tokens = proposer, num_spec_tokens
        # verified steps, draft tokens proposed, drafts accepted (vLLM's spec_decode counters)
        self.spec_counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.spec_accepted_per_pos = [0] * num_spec_tokens  # drafts accepted at each position 0..K-1
        self.propose_seconds = 0.0  # time spent in the proposer (the benchmark's draft / verify split)
        self.planner: AdaptivePlanner | None = None  # adaptive speculation: drafts per sequence and step

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
