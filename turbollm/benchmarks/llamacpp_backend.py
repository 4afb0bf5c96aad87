"""The llama.cpp anchor for `turbollm bench latency --compare llama.cpp`.

Runs the same GGUF file through `llama-cpp-python` (the optional `turbollm[llamacpp]` extra,
built from source so it targets this CPU) in the same process, with the same prompts and the
same thread count, and measures what `benchmarks/latency.py` measures for turbollm:
- prefill: one `eval` of the whole prompt (`n_batch` = prompt length, so one forward), timed;
- decode: `output_len - 1` single-token `eval` calls, each followed by a greedy argmax over the
  last logits (what our engine's greedy step does), timed per token.
The KV cache is reset between iterations. Weights: llama.cpp memory-maps the file, so its
resident weight bytes are the file's tensor bytes.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from turbollm.benchmarks.latency import percentile
from turbollm.errors import BenchmarkError


def load_llamacpp(path: str, n_ctx: int, threads: int, n_batch: int):
    """A `llama_cpp.Llama` on `path`, or a BenchmarkError saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise BenchmarkError("--compare llama.cpp needs llama-cpp-python: pip install 'turbollm[llamacpp]' "
                             "(it compiles llama.cpp for this CPU, ~10 min on 2 cores)") from None
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           n_batch=n_batch, n_ubatch=n_batch, logits_all=False, verbose=False)


def llamacpp_version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "?")


def _greedy(llm) -> int:
    """Argmax of the last evaluated token's logits (read in place from llama.cpp's buffer)."""
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))


def run_llamacpp_latency(llm, prompts: list[list[int]], output_len: int, warmup: int = 1) -> dict:
    """Prefill and greedy decode timings for each prompt (the first `warmup` are not counted)."""
    ttfts, steps = [], []
    for i, ids in enumerate(prompts):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = _greedy(llm)
        ttft = time.perf_counter() - t0
        it_steps = []
        for _ in range(output_len - 1):
            ts = time.perf_counter()
            llm.eval([tok])
            tok = _greedy(llm)
            it_steps.append(time.perf_counter() - ts)
        if i >= warmup:
            ttfts.append(ttft)
            steps += it_steps
    if not ttfts:
        raise BenchmarkError("no measured llama.cpp iterations (num_iters must be >= 1)")
    ttft = statistics.mean(ttfts)
    input_len = len(prompts[-1])
    return {
        "iterations": len(ttfts),
        "ttft_ms_mean": round(1000 * ttft, 2),
        "prefill_tok_per_s": round(input_len / ttft, 2),
        "decode_steps": len(steps),
        "decode_ms_per_step_mean": round(1000 * statistics.mean(steps), 3),
        "decode_ms_per_step_p50": round(1000 * percentile(steps, 50), 3),
        "decode_ms_per_step_p90": round(1000 * percentile(steps, 90), 3),
        "decode_tok_per_s": round(len(steps) / sum(steps), 2),
    }
