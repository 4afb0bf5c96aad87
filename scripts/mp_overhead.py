"""What a worker process costs a decode step (issue 47: the mp executor's batch-1 decode against uni).

    python scripts/mp_overhead.py [MODEL] [--batch 1] [--steps 100]

For each executor ("uni", then "mp") it decodes `--batch` sequences (128-token prompts) for `--steps` steps after
a warm-up and splits the mean step into: the engine's own work (scheduling, updates, output processing), the
send (`Executor.submit`: pickling and writing the step; nothing in-process), and the wait for the output
(`collect`), of which the worker's own time (`ModelRunnerOutput.worker_seconds`: the forward pass and
sampling) and the rest (the pipe back, the processes waking up; negative when the worker started before the
engine began to wait). Run it on the CPU where mp
is slow first: it says whether the worker computes slower beside the engine process or the crossing costs.
"""

import argparse
import time

from turbollm import LLM, SamplingParams


def measure(model: str, backend: str, batch: int, steps: int) -> dict:
    llm = LLM(model, threads=2, distributed_executor_backend=backend)
    eng = llm.engine
    waits, workers, sends = [], [], []
    collect, submit = eng.executor.collect, eng.executor.submit

    def timed_submit(sched):
        t0 = time.perf_counter()
        submit(sched)
        sends.append(time.perf_counter() - t0)

    def timed_collect():
        t0 = time.perf_counter()
        out = collect()
        waits.append(time.perf_counter() - t0)
        workers.append(out.worker_seconds)
        return out

    eng.executor.collect, eng.executor.submit = timed_collect, timed_submit
    params = SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
    for i in range(batch):
        eng.add_request({"prompt_token_ids": [(13 * i + j) % 2000 + 50 for j in range(128)]}, params)
    for _ in range(10):
        eng.step()
    for acc in (waits, workers, sends):
        acc.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = (time.perf_counter() - t0) / steps * 1000
    eng.shutdown()
    wait, worker, send = (sum(x) / steps * 1000 for x in (waits, workers, sends))
    return {"step": wall, "worker": worker, "send": send, "back": wait - worker, "engine": wall - wait - send}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100)
    ns = ap.parse_args()
    print(f"setting: {ns.model}, batch {ns.batch}, {ns.steps} decode steps, 2 threads (ms per step)")
    res = {b: measure(ns.model, b, ns.batch, ns.steps) for b in ("uni", "mp")}
    for b, r in res.items():
        print(f"{b:4s}: step {r['step']:.3f} = engine {r['engine']:.3f} + send {r['send']:.3f} + wait "
              f"{r['worker'] + r['back']:.3f} (worker {r['worker']:.3f}, the rest {r['back']:.3f})")
    print(f"mp / uni decode speed: {res['uni']['step'] / res['mp']['step']:.3f}x")


if __name__ == "__main__":
    main()
