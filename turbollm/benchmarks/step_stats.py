"""Per-step timing and batch composition of a running LLMEngine, without changing the engine.

`StepRecorder(engine)` is a context manager that wraps the engine instance's `step` (timed)
and its scheduler's `schedule` (to see, before the counters advance, how many sequences and
tokens each step carries, which of them are pure decodes, and their context lengths). The
wrappers are instance attributes, removed on exit. If the scheduler does not look as expected,
steps are still timed and the composition is left out. With steps in flight (pipeline stages) a
record is the step a call collected, described when it was handed out, timed by that call.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from turbollm.benchmarks.physics import ModelPhysics


@dataclass(frozen=True)
class StepRecord:
    seconds: float
    num_seqs: int | None = None  # sequences scheduled in the step
    num_tokens: int | None = None  # new tokens through the model (prefill chunks + decodes)
    num_sampled: int | None = None  # sequences that sample a token after the step
    decode_only: bool | None = None  # every scheduled sequence adds one token past its prompt
    context_lens: tuple[int, ...] = ()  # per scheduled sequence, new tokens included
    new_lens: tuple[int, ...] = ()  # per scheduled sequence, its new tokens in the step (same order)


def _describe(sched_out, scheduler) -> dict | None:
    try:
        seqs = [scheduler.seqs[sid] for sid in sched_out.scheduled_token_ids]
        rows = [(s.num_computed_tokens, len(t), s.num_prompt_tokens, s.num_tokens)
                for s, t in zip(seqs, sched_out.scheduled_token_ids.values())]
    except (AttributeError, KeyError):
        return None
    return {"num_seqs": len(rows), "num_tokens": sum(n for _, n, _, _ in rows),
            "num_sampled": sum(c + n == t for c, n, _, t in rows),
            "decode_only": bool(rows) and all(n == 1 and c >= p for c, n, p, _ in rows),
            "context_lens": tuple(c + n for c, n, _, _ in rows), "new_lens": tuple(n for _, n, _, _ in rows)}


class StepRecorder:
    """Record every non-empty `engine.step()` while the `with` block runs."""

    def __init__(self, engine):
        self.engine = engine
        self.records: list[StepRecord] = []
        self._pending: deque[dict | None] = deque()  # descriptions of the steps handed out, not yet collected
        self._scheduler = getattr(engine, "scheduler", None)

    def __enter__(self) -> "StepRecorder":
        engine, sched = self.engine, self._scheduler
        orig_step = engine.step
        if sched is not None and callable(getattr(sched, "schedule", None)):
            orig_schedule = sched.schedule

            def schedule(*a, **k):
                out = orig_schedule(*a, **k)
                if out.scheduled_token_ids:
                    self._pending.append(_describe(out, sched))
                return out

            sched.schedule = schedule

        def step(*a, **k):
            t0 = time.perf_counter()
            res = orig_step(*a, **k)
            dt = time.perf_counter() - t0
            if self._scheduler is None:
                self.records.append(StepRecord(dt))
            elif len(self._pending) > len(getattr(engine, "_in_flight", ())):  # this call collected a step
                info = self._pending.popleft()
                self.records.append(StepRecord(dt) if info is None else StepRecord(dt, **info))
            return res

        engine.step = step
        return self

    def __exit__(self, *exc) -> None:
        self.engine.__dict__.pop("step", None)
        if self._scheduler is not None:
            self._scheduler.__dict__.pop("schedule", None)


def summarize_steps(records: list[StepRecord], phys: ModelPhysics) -> dict:
    """Totals over all steps and over pure-decode steps (None where the composition is unknown)."""
    known = [r for r in records if r.num_seqs is not None]
    out: dict = {"steps": len(records), "step_seconds": sum(r.seconds for r in records)}
    if not known or len(known) != len(records):
        return out
    decode = [r for r in known if r.decode_only]
    out.update(
        processed_tokens=sum(r.num_tokens for r in known),
        sampled_rows=sum(r.num_sampled for r in known),
        mean_batch_seqs=sum(r.num_seqs for r in known) / len(known),
        max_batch_seqs=max(r.num_seqs for r in known),
        mean_tokens_per_step=sum(r.num_tokens for r in known) / len(known),
        kv_bytes=sum(phys.kv_bytes_read(c) for r in known for c in r.context_lens),
        decode_steps=len(decode),
        decode_seconds=sum(r.seconds for r in decode),
        decode_tokens=sum(r.num_tokens for r in decode),
        decode_mean_batch=(sum(r.num_seqs for r in decode) / len(decode)) if decode else 0.0,
        decode_kv_bytes=sum(phys.kv_bytes_read(c) for r in decode for c in r.context_lens),
    )
    return out
