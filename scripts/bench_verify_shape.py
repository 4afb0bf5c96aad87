"""Cost of one step that brings k new tokens of one sequence over 256 cached tokens (the shape of
speculative verification), against a 1-token step.

    python scripts/bench_verify_shape.py qwen2.5-coder-1.5b [qmatmul]

A 256-token random prompt is computed once (its 16 blocks stay in the prefix cache); then requests
of that prompt + k fresh tokens each take one engine step that computes exactly the k tokens
(fused when the step allows it). Median of 7 per k; GGUF default weights, float16 K/V, 2 threads.
Per k it prints the bytes the step reads (the weights once, plus each new token's K/V reads: the
step attends one decode per token) and the GOP/s of its matmuls (2 x decoder linear params x k,
plus the LM head's one sampled row).
"""

from __future__ import annotations

import sys
import time

import torch

from turbollm import SamplingParams
from turbollm.benchmarks.physics import physics_of_turbollm
from turbollm.engine.llm_engine import LLMEngine
from turbollm.engine_args import EngineArgs


def main() -> None:
    model = sys.argv[1]
    qmatmul = sys.argv[2] if len(sys.argv) > 2 else None
    eng = LLMEngine(EngineArgs(model=model, kv_cache_memory=256 << 20, threads=2, qmatmul=qmatmul))
    runner = getattr(eng.executor, "worker").runner
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, 20000, (256,), generator=g).tolist()
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)

    def run(ids):
        eng.add_request({"prompt_token_ids": ids}, one)
        times = []
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        return times

    run(prompt)
    res: dict[int, list[tuple[float, int]]] = {}
    for _ in range(7):
        for k in (1, 2, 3, 5, 8):
            before = runner.fused.steps if runner.fused is not None else 0
            times = run(prompt + torch.randint(1000, 20000, (k,), generator=g).tolist())
            assert len(times) == 1, "the k tokens did not run in one step"
            res.setdefault(k, []).append((times[0], (runner.fused.steps if runner.fused is not None else 0) - before))
    kv_item = eng.executor.worker.runner.kv_caches[0].k.element_size()
    phys = physics_of_turbollm(eng.footprint, eng.config, kv_item)
    print(f"{model}, qmatmul {qmatmul or 'auto'}, 256 cached tokens, 2 threads, "
          f"{phys.step_weight_bytes / 1e6:.0f} MB of weights per step")
    base = sorted(t for t, _ in res[1])[3]
    for k, v in res.items():
        med = sorted(t for t, _ in v)[3]
        read = phys.step_weight_bytes + sum(phys.kv_bytes_read(256 + j + 1) for j in range(k))
        print(f"  k={k}: median step {med * 1e3:.2f} ms = {med / base:.2f}x the 1-token step "
              f"({'fused' if v[0][1] else 'modules'}); reads {read / 1e6:.0f} MB ({read / med / 1e9:.1f} GB/s), "
              f"{phys.flops(k, 1) / med / 1e9:.1f} GOP/s")


if __name__ == "__main__":
    main()
