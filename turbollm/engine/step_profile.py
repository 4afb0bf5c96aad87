"""The target's step time by rows, measured at start-up for the adaptive speculation planner
(turbollm/spec_decode/adaptive.py: `StepCosts`), through the engine's public step path: for a few R,
R scratch requests (one short prompt, shared through the prefix cache) decode a few tokens together with
speculation held off, so every step after their prefill has R rows; `Scheduler.observe_step` times those
steps as it times every decode step the engine runs (a worker process included)."""

from __future__ import annotations

from turbollm.sampling_params import SamplingParams


def profile_step_costs(engine, rows=(1, 2, 4, 8, 16), steps: int = 4, context: int = 16) -> None:
    """Run decode steps of each R in `rows` (up to max_num_seqs) on scratch requests; the scheduler's planner
    takes their times. The requests finish here; nothing of them stays but what the prefix cache keeps."""
    sched = engine.scheduler
    k, sched.num_spec_tokens = sched.num_spec_tokens, 0  # plain decode-shaped steps: no drafts
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    context = max(1, min(context, engine.max_model_len - steps - 2))
    try:
        for r in rows:
            if r > engine.args.max_num_seqs:
                break
            for i in range(r):
                engine.add_request([1] * context, params, request_id=f"turbollm-profile-{r}-{i}")
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        sched.num_spec_tokens = k
