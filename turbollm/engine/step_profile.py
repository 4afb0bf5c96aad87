"""The target's step time by rows, measured at start-up for the adaptive speculation planner
(turbollm/spec_decode/adaptive.py: `StepCosts`): a scratch sequence takes a few blocks of the pool,
prefills a short prompt, then runs verification-shaped steps of R tokens for a few R (every row
sampled, as a step that verifies R - 1 drafts samples them), each timed through
the executor (a worker process included) as the engine's steps are; its blocks go back to the pool
and the workers drop it at the next step."""

from __future__ import annotations

import time

from turbollm.core.sequence import Sequence
from turbollm.handoff.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from turbollm.sampling_params import SamplingParams
from turbollm.spec_decode.adaptive import StepCosts


def profile_step_costs(executor, kv, costs: StepCosts, seq_id: int, rows=(1, 2, 4, 8, 16), repeats: int = 3,
                       context: int = 64) -> int:
    """Time the target's verification-shaped steps at a few row counts on a scratch sequence (a `context`-token
    prompt, then steps of R tokens), feeding `costs`; returns the scratch sequence's id, which the
    caller reports finished to the workers. Its blocks go back to the pool."""
    params = SamplingParams(temperature=0.0, max_tokens=None)
    total = context + (repeats + 1) * sum(rows) + 1
    seq = Sequence(seq_id, "profile", 0, [1] * context, params)
    if not kv.can_allocate(kv.blocks_needed(seq, total)):
        return seq_id  # a pool too small to profile in: the costs come from the steps that run
    kv.grow(seq, total)
    tables = tuple(list(t) for t in seq.block_tables)
    try:
        executor.execute_model(SchedulerOutput(
            new_reqs=[NewRequestData(seq_id, 0, [1] * context, context, params, [], tables, 0)],
            scheduled_token_ids={seq_id: [1] * context}))
        done = context
        for round_ in range(repeats + 1):  # the first round warms up and is not counted
            for r in rows:
                # the R - 1 tokens after the first as drafts: every row is sampled, as in a verification
                sched = SchedulerOutput(cached_reqs=[CachedRequestData(seq_id, tuple([] for _ in tables), done)],
                                        scheduled_token_ids={seq_id: [1] * r},
                                        spec_token_ids={seq_id: [1] * (r - 1)} if r > 1 else {})
                t0 = time.perf_counter()
                executor.execute_model(sched)
                if round_ > 0:
                    costs.observe(r, time.perf_counter() - t0)
                done += r
    finally:
        kv.free(seq)
    return seq_id
