"""The worker's side of speculative decoding: after each step, drafts for the sequences the scheduler left
room for (`SchedulerOutput.draft_room`), from the tokens the step just sampled.

`Drafter` owns the proposer (`spec_decode/proposers.py`'s registry: n-gram, suffix trees, a draft model)
and tells it what the step's hand-off says: sequences finished (with their generated tokens) or preempted
(their blocks are gone) before the step, the drafts to make after it. A draft model gets its own runner
(worker/draft_runner.py), loaded by the worker that gives the step's output and addressed through the
target sequence's block table as this worker holds it; no other runner's state is written. The drafts,
the proposer's time and its cost per draft go back in `ModelRunnerOutput`; verification is
worker/rejection.py's, in the target's next step.
"""

from __future__ import annotations

import time

import torch

from turbollm.engine_config import ModelArgs
from turbollm.handoff.kv_cache_spec import KVCacheConfig
from turbollm.handoff.runner_output import ModelRunnerOutput
from turbollm.handoff.scheduler_output import SchedulerOutput
from turbollm.spec_decode.config import SpeculativeConfig
from turbollm.spec_decode.proposers import Proposer, ProposerContext, make_proposer


class Drafter:
    def __init__(self, proposer: Proposer, threads: int | None = None):
        self.proposer = proposer
        # a rank of a parallel engine drafts while the other ranks wait for the next step: the draft may use the
        # cores of this host's ranks (None: the process's own threads)
        self.threads = threads

    @classmethod
    def build(cls, config: SpeculativeConfig, model: ModelArgs, states: dict, block_size: int,
              draft_kv_config: KVCacheConfig | None, threads: int | None = None) -> "Drafter":
        """The proposer `config` names, for a runner whose per-sequence states are `states` (seq_id ->
        `SeqState`); `model`: the target's (a draft model computes as it does); `draft_kv_config`: a draft
        model's K/V, sized by the engine (the target pool's blocks)."""
        def load_draft(cfg: SpeculativeConfig):
            from turbollm.worker.draft_runner import DraftRunner

            return DraftRunner.load(cfg, model, draft_kv_config, block_size)

        return cls(make_proposer(config, ProposerContext(
            block_size, block_table=lambda seq_id: states[seq_id].block_ids[0], make_draft_runner=load_draft)),
            threads)

    def before_step(self, sched: SchedulerOutput, states: dict) -> None:
        """What ended since the last step: finished sequences (their generated tokens, for a proposer that
        learns from outputs) and preempted ones (K/V written into their blocks is gone)."""
        for sid in sched.finished_seq_ids:
            st = states.get(sid)
            if st is not None:
                self.proposer.finish(sid, st.token_ids[st.num_prompt_tokens:])
        for sid in sched.preempted_seq_ids:
            self.proposer.preempted(sid)

    def after_step(self, sched: SchedulerOutput, out: ModelRunnerOutput, states: dict) -> None:
        """Drafts for each sequence given room that sampled this step, into `out`."""
        t0 = time.perf_counter()
        own = torch.get_num_threads()
        if self.threads and self.threads != own:
            torch.set_num_threads(self.threads)
        try:
            for sid, room in sched.draft_room.items():
                if sid in out.errors or sid not in out.sampled:
                    continue
                drafts = self.proposer.propose(sid, states[sid].token_ids, room)
                if drafts:
                    out.draft_token_ids[sid] = drafts[:room]
        finally:
            if torch.get_num_threads() != own:
                torch.set_num_threads(own)
        out.propose_seconds = time.perf_counter() - t0
        out.seconds_per_draft = self.proposer.seconds_per_draft
