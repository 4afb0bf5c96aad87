"""Tokens each K/V format holds in one budget, and a quantized format's rings drawn from the pool (issue 47).

    python scripts/kv_capacity.py [MODEL] [--budgets 3.5 0.25] [--requests 64]

Per budget (GiB) and kv_cache_dtype (float16, int8, int4; each at its default block size) it starts the engine
and prints the pool's tokens and their ratio to float16's. Then, at the smallest budget, each quantized format
serves `--requests` concurrent requests (128-token prompts, 64 tokens each, the default max_num_seqs 64) and
prints how many ran at once (each with its float16 ring), the peak K/V bytes against the budget, and that
every request finished.
"""

from __future__ import annotations

import argparse
import time

GiB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--budgets", type=float, nargs="+", default=[3.5, 0.25])
    ap.add_argument("--requests", type=int, default=64)
    ns = ap.parse_args()
    from turbollm import LLM, SamplingParams

    print(f"setting: model={ns.model} budgets={ns.budgets} GiB, default max_num_seqs (64), kv_recent_window 128")
    llms = {}
    for gib in ns.budgets:
        base = None
        for dtype in ("float16", "int8", "int4"):
            llm = LLM(ns.model, kv_cache_dtype=dtype, kv_cache_memory=int(gib * GiB))
            kv = llm.engine.kv_config
            base = base or kv.num_tokens
            print(f"{gib:5.2f} GiB {dtype:8s} block {kv.block_size:2d}: {kv.num_blocks:6d} blocks, {kv.num_tokens:8d} tokens"
                  f" = {kv.num_tokens / base:.3f}x float16; {kv.total_bytes / GiB:.3f} GiB"
                  + (f"; a ring takes {kv.ring_blocks} blocks, at most {kv.ring_slots} at once" if kv.ring_blocks else ""))
            if gib == min(ns.budgets) and dtype != "float16":
                llms[dtype] = llm
            else:
                llm.engine.shutdown()
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(128)]} for i in range(ns.requests)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for dtype, llm in llms.items():
        eng = llm.engine
        for p in prompts:
            eng.add_request(p, params)
        most, t0, done = 0, time.perf_counter(), 0
        while eng.has_unfinished_requests():
            done += sum(o.finished for o in eng.step())
            most = max(most, eng.kv_manager.num_rings)
        s = eng.stats()
        print(f"{min(ns.budgets)} GiB {dtype}: {done}/{len(prompts)} requests finished in {time.perf_counter() - t0:.1f} s;"
              f" at most {most} ran at once with their rings; preemptions {s['num_preemptions']}; peak K/V "
              f"{s['kv_cache_bytes_peak'] / GiB:.3f} of {s['kv_cache_bytes_total'] / GiB:.3f} GiB")


if __name__ == "__main__":
    main()
