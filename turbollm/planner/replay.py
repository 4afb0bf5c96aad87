"""A workload run on a real engine in this process, requests added at their arrival times: each request's
TTFT, inter-token latencies and end-to-end time, as the planner's simulation reports them (`SimResult`), so
the two compare line for line and the tuner measures what the planner predicts."""

from __future__ import annotations

import time

from turbollm.planner.simulate import SimResult
from turbollm.planner.workload import Workload


def replay(engine, workload: Workload, seed: int = 0, time_limit: float | None = None,
           observe=None) -> SimResult:
    """Run `workload` on `engine` (an LLMEngine): each request's token ids are the workload's own prompts, or
    random ids of its length. Requests not finished by `time_limit` seconds are aborted and left out of the
    lists. `observe(engine, outputs)`, when given, sees every step's outputs (request ids `replay-<index>`)."""
    import random

    from turbollm.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = min(engine.tokenizer.vocab_size, 20000)
    order = sorted(range(len(workload.items)), key=lambda i: workload.items[i].arrival)
    seen: dict[str, int] = {}
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itl: list[float] = []
    done: list[str] = []
    out_tokens, steps, step_seconds = 0, 0, []
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        if time_limit is not None and now > time_limit:
            for rid in list(arrival):
                if rid not in done:
                    engine.abort(rid)
            break
        while nxt < len(order) and workload.items[order[nxt]].arrival <= now:
            i = order[nxt]
            it = workload.items[i]
            ids = (list(workload.prompts[i]) if workload.prompts is not None
                   else [rng.randrange(100, vocab) for _ in range(it.prompt_len)])
            rid = f"replay-{i}"
            engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=it.output_len, ignore_eos=True),
                               request_id=rid)
            arrival[rid], seen[rid] = t0 + it.arrival, 0
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, workload.items[order[nxt]].arrival - now))
            continue
        s0 = time.perf_counter()
        outs = engine.step()
        t = time.perf_counter()
        steps += 1
        step_seconds.append(t - s0)
        if observe is not None:
            observe(engine, outs)
        for o in outs:
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            rid = o.request_id
            if rid not in seen:
                continue
            if n > seen[rid]:
                new = n - seen[rid]
                out_tokens += new
                if rid not in first:
                    first[rid] = t
                else:
                    itl.extend([(t - last[rid]) / new] * new)  # tokens of one step share its interval
                last[rid] = t
                seen[rid] = n
            if o.finished:
                done.append(rid)
    duration = time.perf_counter() - t0
    ok = [r for r in done if r in first]
    return SimResult(duration, out_tokens, steps, [first[r] - arrival[r] for r in ok], itl,
                     [last[r] - arrival[r] for r in ok], 0, 0, 0, step_seconds,
                     tpot=[(last[r] - first[r]) / max(1, seen[r] - 1) for r in ok])
