"""The engine's scheduling replayed on paper: which steps a workload makes, each one timed by the cost model.

The rules are the scheduler's (core/scheduler.py): each step first serves the running sequences (one token
for a decoding one, the next chunk of a prompt still being prefilled), then admits waiting requests in
arrival order while the step has sequence slots (`max_num_seqs`), tokens (`max_num_batched_tokens`: a long
prompt is cut into chunks) and free KV blocks; a decoding sequence that needs a block when none is free
preempts the newest running one, whose K/V is dropped and recomputed when it is admitted again. A request's
first token comes at the end of the step that finishes its prompt; every later step it is in gives one more.
Not modelled: prefix-cache hits, speculative decoding, steps in flight (pipeline stages).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turbollm.planner.cost_model import StepCostModel, StepShape
from turbollm.planner.workload import Workload


@dataclass(eq=False)
class _Seq:
    idx: int
    prompt: int
    output: int
    arrival: float
    computed: int = 0  # tokens with K/V
    generated: int = 0
    first_token: float | None = None
    last_token: float | None = None
    itl: list[float] = field(default_factory=list)


@dataclass
class SimResult:
    duration: float
    output_tokens: int
    steps: int
    ttft: list[float]
    itl: list[float]
    e2e: list[float]
    peak_running: int
    peak_kv_tokens: int
    preemptions: int
    step_seconds: list[float]
    blocks_allocated: int = 0  # every block a sequence took, over the run (a block reused counts again)
    peak_blocks: int = 0
    tpot: list[float] = field(default_factory=list)  # per request (as ttft): its mean time per output token after
    # the first
    max_step_tokens: int = 0  # the largest step's new tokens (its activations are the run's peak)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration if self.duration > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return len(self.ttft) / self.duration if self.duration > 0 else 0.0


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def simulate(workload: Workload, cost: StepCostModel, max_num_seqs: int, max_num_batched_tokens: int,
             kv_tokens: int | None, block_size: int, max_steps: int = 2_000_000) -> SimResult:
    """Replay `workload`; `kv_tokens` is what the KV pool holds (None: no limit, a policy that releases)."""
    pending = sorted((_Seq(i, it.prompt_len, it.output_len, it.arrival) for i, it in enumerate(workload.items)),
                     key=lambda s: (s.arrival, s.idx))
    free = None if kv_tokens is None else kv_tokens // block_size
    waiting: list[_Seq] = []
    running: list[_Seq] = []
    done: list[_Seq] = []
    held: dict[int, int] = {}  # blocks per running sequence
    now, steps, out_tokens, preemptions, peak_running, peak_blocks, allocated = 0.0, 0, 0, 0, 0, 0, 0
    max_tokens = 0
    step_seconds: list[float] = []
    while (pending or waiting or running) and steps < max_steps:
        while pending and pending[0].arrival <= now:
            waiting.append(pending.pop(0))
        if not waiting and not running:
            now = pending[0].arrival
            continue
        budget, plan = max_num_batched_tokens, []  # (seq, new tokens)
        for s in list(running):
            if budget <= 0:
                break
            if s not in running:  # preempted earlier in this step
                continue
            want = min(s.prompt + s.generated - s.computed, budget)  # 1 for a decoding sequence
            need = _blocks(s.computed + want, block_size) - held[s.idx]
            while free is not None and need > free:
                victim = running[-1]
                if victim is s:
                    break
                running.pop()
                plan = [(q, n) for q, n in plan if q is not victim]
                free += held.pop(victim.idx)
                victim.computed = 0
                waiting.insert(0, victim)
                preemptions += 1
            if free is not None and need > free:
                continue
            if free is not None:
                free -= need
            allocated += need
            held[s.idx] += need
            plan.append((s, want))
            budget -= want
        while waiting and budget > 0 and len(running) < max_num_seqs:
            s = waiting[0]
            total = s.prompt + s.generated  # a preempted sequence recomputes what it had generated too
            want = min(total - s.computed, budget)
            need = _blocks(s.computed + want, block_size)
            if free is not None and need > free:
                break
            waiting.pop(0)
            if free is not None:
                free -= need
            allocated += need
            held[s.idx] = need
            running.append(s)
            plan.append((s, want))
            budget -= want
        if not plan:  # nothing fits (a KV pool too small for one sequence): the engine would refuse it
            break
        shape = StepShape(tuple(n for _, n in plan), tuple(s.computed for s, _ in plan))
        max_tokens = max(max_tokens, shape.num_tokens)
        dt = cost.predict(shape)
        now += dt
        steps += 1
        step_seconds.append(dt)
        peak_running = max(peak_running, len(running))
        peak_blocks = max(peak_blocks, sum(held.values()))
        for s, n in plan:
            s.computed += n
            if s.computed < s.prompt + s.generated:
                continue  # a prompt chunk that does not end the prompt
            s.generated += 1
            out_tokens += 1
            if s.first_token is None:
                s.first_token = now
            elif s.last_token is not None:
                s.itl.append(now - s.last_token)
            s.last_token = now
            if s.generated >= s.output:
                running.remove(s)
                if free is not None:
                    free += held.pop(s.idx)
                else:
                    held.pop(s.idx)
                done.append(s)
    return SimResult(now, out_tokens, steps, [s.first_token - s.arrival for s in done],
                     [x for s in done for x in s.itl], [s.last_token - s.arrival for s in done], peak_running,
                     peak_blocks * block_size, preemptions, step_seconds, allocated, peak_blocks,
                     [(s.last_token - s.first_token) / max(1, s.generated - 1) for s in done], max_tokens)
