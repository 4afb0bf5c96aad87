"""One configuration of the ablation (ablation/study.py), in a process of its own so that its peak memory
and its kernels are its own: `python -m turbollm.ablation.run_one JOB.json RESULT.json`.

The job holds the engine arguments, the requests' token ids and the new tokens each. The engine is built, a
short request of other tokens warms it, the processes' peak memory is reset, then every request is added at
once (an offline batch) and the engine is stepped until all are done (planner/replay.py). The result: time,
tokens, TTFT (from the batch's start, so a request that waits for others counts its wait) and inter-token
latencies, each request's tokens (greedy), the KV pool's capacity, the most requests running at once, the
process tree's peak memory over the run (each process at its own peak: the engine's and its workers', loading
left out) and the engine's counters."""

from __future__ import annotations

import json
import sys


def run_job(job: dict) -> dict:
    from turbollm.engine.llm_engine import LLMEngine
    from turbollm.engine_args import EngineArgs
    from turbollm.planner.replay import replay
    from turbollm.planner.workload import WorkItem, Workload
    from turbollm.procfs import reset_tree_peak, tree_peak_bytes
    from turbollm.sampling_params import SamplingParams

    args = EngineArgs.from_kwargs(**job["engine"])
    engine = LLMEngine.from_engine_args(args)
    try:
        vocab = min(engine.tokenizer.vocab_size, 1000)
        warm = [3 + (i * 131) % (vocab - 3) for i in range(24)]  # no request of the workload starts so
        engine.add_request(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), request_id="warm")
        while engine.has_unfinished_requests():
            engine.step()
        reset_tree_peak()  # the peak of the run, not of loading
        prompts = [tuple(p) for p in job["prompts"]]
        work = Workload("ablation", tuple(WorkItem(len(p), job["max_tokens"]) for p in prompts), tuple(prompts))
        tokens: dict[str, list[int]] = {}
        most_running = [0]

        def observe(eng, outs) -> None:
            most_running[0] = max(most_running[0], len(eng.scheduler.running))
            for o in outs:
                if o.outputs:
                    tokens[o.request_id] = list(o.outputs[0].token_ids)

        run = replay(engine, work, observe=observe)
        stats = engine.stats()
        peak = tree_peak_bytes()
    finally:
        engine.shutdown()
    return {
        "seconds": run.duration, "output_tokens": run.output_tokens, "steps": run.steps,
        "ttft": run.ttft, "itl": run.itl, "tpot": run.tpot,
        "tokens": [tokens.get(f"replay-{i}", []) for i in range(len(prompts))],
        "kv_tokens": stats["kv_blocks_total"] * args.block_size, "most_running": most_running[0],
        "peak_bytes": peak, "prefix_cache_hits": stats["prefix_cache_hits"],
        "prefix_cache_queries": stats["prefix_cache_queries"], "preemptions": stats["num_preemptions"],
        "spec_drafted": stats.get("spec_decode_num_draft_tokens"),
        "spec_accepted": stats.get("spec_decode_num_accepted_tokens"),
    }


def main(argv: list[str]) -> int:
    job_path, out_path = argv
    with open(job_path) as f:
        job = json.load(f)
    res = run_job(job)
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
