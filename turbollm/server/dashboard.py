"""The dashboard's data: the engine's and the server's counters sampled every second, as JSON.

`Dashboard.sample()` reads `LLMEngine.stats()` (plain ints owned by the worker thread: a read from the
event loop sees a value at most one step old, as /metrics does) and the server's own counters, and
turns the change since the previous sample into rates: steps, mean sequences and tokens per step,
generated tokens per second, the prefix cache's hit rate and speculative decoding's acceptance over
the interval. Samples are kept for `window` seconds. TTFT and inter-token latencies are kept as
observations for the same window (`LatencyWindow`), so their percentiles are over the last minutes,
not since start. `GET /stats` returns the latest state, the samples after `?since=` and the percentiles.

A JSON endpoint rather than /metrics parsed in the browser: the page would need a Prometheus text
parser and would only see cumulative counters (rates would depend on the page's own polling jitter),
and the histograms' fixed buckets cannot give a p99 of the last minutes.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from typing import Any

PERCENTILES = (50, 90, 99)


class LatencyWindow:
    """(time, seconds) observations of the last `window` seconds, at most `max_items` of them."""

    def __init__(self, window: float = 300.0, max_items: int = 200_000):
        self.window = window
        self.items: deque[tuple[float, float]] = deque(maxlen=max_items)

    def add(self, now: float, value: float, count: int = 1) -> None:
        for _ in range(count):
            self.items.append((now, value))

    def summary(self, now: float) -> dict[str, Any]:
        """count, mean and the PERCENTILES (nearest rank) of the observations within the window, in ms."""
        while self.items and self.items[0][0] < now - self.window:
            self.items.popleft()
        values = sorted(v for _, v in self.items)
        if not values:
            return {"count": 0, "mean_ms": None, **{f"p{p}_ms": None for p in PERCENTILES}}
        n = len(values)
        out: dict[str, Any] = {"count": n, "mean_ms": 1e3 * sum(values) / n}
        for p in PERCENTILES:
            out[f"p{p}_ms"] = 1e3 * values[min(n - 1, max(0, -(-p * n // 100) - 1))]
        return out


class Dashboard:
    def __init__(self, engine: Any, metrics: Any, period: float = 1.0, window: float = 300.0):
        """`engine`: the LLMEngine (its `stats()`); `metrics`: the ServerMetrics (tokens streamed, requests
        finished, the latency windows)."""
        self.engine, self.metrics = engine, metrics
        self.period, self.window = period, window
        self.samples: deque[dict[str, Any]] = deque(maxlen=int(window / period) + 1)
        self._prev: tuple[float, dict[str, Any], int, int] | None = None
        self.started = time.time()

    def sample(self, now: float | None = None, stats: dict[str, Any] | None = None) -> dict[str, Any]:
        """One sample: the engine's gauges now (`stats`: an `LLMEngine.stats()` just read), and the rates since
        the previous sample."""
        now = time.time() if now is None else now
        s = self.engine.stats() if stats is None else stats
        tokens, finished = self.metrics.tokens_streamed, self.metrics.requests_finished
        groups = s.get("kv_groups", [])
        out: dict[str, Any] = {
            "t": now, "running": s["num_requests_running"], "waiting": s["num_requests_waiting"],
            "kv_usage": s["kv_cache_usage"], "kv_blocks_used": [g["blocks_used"] for g in groups],
            "kv_bytes_used": s.get("kv_cache_bytes_used", 0),
            "generation_tokens": tokens, "requests_finished": finished,
        }
        if self._prev is not None:
            t0, s0, tokens0, _ = self._prev
            dt = max(now - t0, 1e-9)
            steps = s["num_steps"] - s0["num_steps"]
            out["steps"] = steps
            out["steps_per_s"] = steps / dt
            out["batch_size"] = (s["num_step_seqs"] - s0["num_step_seqs"]) / steps if steps else 0.0
            out["tokens_per_step"] = (s["num_step_tokens"] - s0["num_step_tokens"]) / steps if steps else 0.0
            out["generation_tps"] = (tokens - tokens0) / dt
            out.update(_counter_rates(s, s0))
        self._prev = (now, s, tokens, finished)
        self.samples.append(out)
        return out

    def maybe_sample(self, stats: dict[str, Any] | None = None) -> None:
        """Sample when the last one is a period old (or there is none): a request for /stats keeps the history
        current even where the background task does not run (an app served without its lifespan)."""
        if not self.samples or time.time() - self.samples[-1]["t"] >= self.period:
            self.sample(stats=stats)

    async def run(self) -> None:
        """Sample every `period` seconds until cancelled."""
        while True:
            self.maybe_sample()
            await asyncio.sleep(self.period)

    def snapshot(self, since: float | None = None) -> dict[str, Any]:
        """The JSON of GET /stats: totals now, the samples after `since` (all kept without it), the
        latency percentiles of the window."""
        s = self.engine.stats()
        self.maybe_sample(s)
        now = time.time()
        samples = list(self.samples)
        if since is not None:
            samples = samples[bisect.bisect_right([x["t"] for x in samples], since):]
        bytes_by_dtype: dict[str, int] = {}
        for g in s.get("kv_groups", []):
            key = g["dtype"] if g["kind"] != "recent" else "float16 (recent-token rings)"
            bytes_by_dtype[key] = bytes_by_dtype.get(key, 0) + g["bytes_used"]
        totals: dict[str, Any] = {
            "running": s["num_requests_running"], "waiting": s["num_requests_waiting"],
            "steps": s["num_steps"], "generation_tokens": self.metrics.tokens_streamed,
            "requests_finished": self.metrics.requests_finished,
            "kv_usage": s["kv_cache_usage"], "kv_blocks_used": s["kv_blocks_used"], "kv_blocks_total": s["kv_blocks_total"],
            "kv_bytes_used": s.get("kv_cache_bytes_used", 0), "kv_bytes_total": s.get("kv_cache_bytes_total", 0),
            "kv_bytes_by_dtype": bytes_by_dtype, "kv_groups": s.get("kv_groups", []),
            "prefix_cache_queries": s["prefix_cache_queries"], "prefix_cache_hits": s["prefix_cache_hits"],
            "num_preemptions": s["num_preemptions"], "speculative": "spec_decode_num_drafts" in s,
            **_counter_rates(s, {}),  # since start
        }
        return {"model": self.metrics.model_name, "time": now, "uptime_s": now - self.started,
                "period_s": self.period, "window_s": self.window, "totals": totals, "samples": samples,
                "latency": {"ttft": self.metrics.recent_ttft.summary(time.monotonic()),
                            "itl": self.metrics.recent_itl.summary(time.monotonic())}}


def _counter_rates(s: dict[str, Any], s0: dict[str, Any]) -> dict[str, float | None]:
    """The prefix cache's hit rate and, with speculation, the acceptance rate and the mean tokens a verification
    step yields, over the counters' change from `s0` to `s` (`{}`: since start)."""
    def d(key: str) -> int:
        return s[key] - s0.get(key, 0)

    queries = d("prefix_cache_queries")
    out: dict[str, float | None] = {"prefix_hit_rate": d("prefix_cache_hits") / queries if queries else None}
    if "spec_decode_num_drafts" in s:
        drafts, proposed = d("spec_decode_num_drafts"), d("spec_decode_num_draft_tokens")
        accepted = d("spec_decode_num_accepted_tokens")
        out["spec_acceptance_rate"] = accepted / proposed if proposed else None
        out["spec_mean_accepted_length"] = 1 + accepted / drafts if drafts else None
    return out
