"""Prefix caching: time to first token of requests that share a long system prompt.

A system prompt of `system_len` tokens (cut from the ShareGPT prompts, not from any
evaluation set) is followed by a different short question per request. Requests run one
after the other; the first computes the whole prompt, the next ones find the system
prompt's full blocks in the cache. Reported: TTFT of each request, the ratio first/rest,
and the pool's counters (queries, hits, evictions) that explain it. The same requests
are then run with prefix caching off as the control.
"""

from __future__ import annotations

import time

from turbollm.sampling_params import SamplingParams


def _ttft(engine, ids: list[int]) -> float:
    t0 = time.perf_counter()
    rid = engine.add_request({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.outputs[0].token_ids and first is None:
                first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def run_prefix_cache(engine, system_ids: list[int], questions: list[list[int]]) -> dict:
    """TTFT per request (system prompt + question), with the pool's prefix-cache counters."""
    stats = engine.kv_manager.stats
    before = (stats.queries, stats.hits, stats.evictions)
    ttfts = [_ttft(engine, system_ids + q) for q in questions]
    rest = sorted(ttfts[1:])
    median_rest = rest[len(rest) // 2] if rest else float("nan")
    return {
        "prefix_caching": engine.kv_manager.enable_caching,
        "system_tokens": len(system_ids),
        "requests": len(questions),
        "ttft_s": [round(t, 4) for t in ttfts],
        "first_ttft_s": round(ttfts[0], 4),
        "median_later_ttft_s": round(median_rest, 4),
        "speedup_first_over_later": round(ttfts[0] / median_rest, 2) if rest else None,
        "cache_query_tokens": stats.queries - before[0],
        "cache_hit_tokens": stats.hits - before[1],
        "cache_evictions": stats.evictions - before[2],
        "hit_rate": round((stats.hits - before[1]) / max(1, stats.queries - before[0]), 3),
    }
