"""Prefill of one long random prompt: tok/s and peak RSS above the loaded process, one engine per process.

    python scripts/bench_long_prefill.py turbollm qwen2.5-coder-0.5b 4096
    python scripts/bench_long_prefill.py llama.cpp qwen2.5-coder-0.5b 4096   # flash_attn=True

The engine (or llama_cpp.Llama on the same GGUF file) is loaded and warmed on 64 tokens, the peak
RSS mark is reset (/proc/self/clear_refs), then N random token ids (1000..20000, seed 0) are
prefilled and timed. turbollm: GGUF default weights and K/V dtype, chunks of max_num_batched_tokens
(2,048), prefix caching off, 2 threads. Run the engines one after the other, never in parallel.
"""

from __future__ import annotations

import sys
import time

import torch


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    impl, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ids = torch.randint(1000, 20000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    if impl == "llama.cpp":
        import llama_cpp

        from turbollm.hub.resolve import resolve_model

        llm = llama_cpp.Llama(str(resolve_model(model).path), n_ctx=n + 16, n_threads=2, n_threads_batch=2,
                              flash_attn=True, n_batch=2048, verbose=False)
        llm.eval(ids[:64])
        llm.reset()
        reset_peak()
        base = peak_rss_mib()
        t = time.perf_counter()
        llm.eval(ids)
    else:
        from turbollm import SamplingParams
        from turbollm.engine_args import EngineArgs
        from turbollm.engine.llm_engine import LLMEngine

        eng = LLMEngine(EngineArgs(model=model, max_model_len=n + 64, kv_cache_memory=None, threads=2,
                                   enable_prefix_caching=False, max_num_seqs=1))

        def run(x):
            eng.add_request({"prompt_token_ids": x}, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
            while eng.has_unfinished_requests():
                eng.step()

        run(ids[:64])
        reset_peak()
        base = peak_rss_mib()
        t = time.perf_counter()
        run(ids)
    dt = time.perf_counter() - t
    print(f"{impl} {model} prompt {n} tokens, 2 threads: prefill {n / dt:.1f} tok/s ({dt:.1f} s), "
          f"peak RSS +{peak_rss_mib() - base:.0f} MiB over {base:.0f} MiB")


if __name__ == "__main__":
    main()
