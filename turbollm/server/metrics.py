"""Prometheus metrics under vLLM's names, prefixed `turbollm:`, in a registry of our own.

Gauges and the engine's own counters (prefix cache, preemptions, speculative decoding's drafts and
accepted tokens when it is on) are read from
`LLMEngine.stats()` at scrape time: they are plain ints and lengths owned by the worker
thread, so a read from the event loop sees a value at most one step old. Token counts,
finished requests and the latency histograms are recorded by the server per request.

Queue time: HTTP arrival to `RequestOutput.metrics["first_scheduled_time"]`, the engine's
time.monotonic() of the first step that ran the request (without it — an engine that does
not report it — arrival to first output, an upper bound that includes the prefill).
"""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from turbollm.server.dashboard import LatencyWindow

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
P = "turbollm:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class _EngineCollector:
    """Reads the engine's counters when /metrics is scraped."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s = self.engine.stats()
        labels = ["model_name"]
        for name, doc, value in (
                ("num_requests_running", "Sequences in the running batch.", s["num_requests_running"]),
                ("num_requests_waiting", "Sequences waiting to be scheduled.", s["num_requests_waiting"]),
                ("kv_cache_usage_perc", "KV-cache usage, a fraction in [0, 1].", s["kv_cache_usage"])):
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            g.add_metric([self.model_name], float(value))
            yield g
        for name, doc in (("kv_cache_bytes_used", "K/V bytes of the KV-cache blocks in use, every layer group."),
                          ("kv_cache_bytes_peak", "The most K/V bytes in use at once since start."),
                          ("kv_cache_bytes_total", "K/V bytes allocated for the KV cache.")):
            if name in s:  # our own gauges (vLLM has none by these names)
                g = GaugeMetricFamily(P + name, doc, labels=labels)
                g.add_metric([self.model_name], float(s[name]))
                yield g
        counters = [("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
                    ("num_preemptions", "Sequences preempted (recomputed) for lack of KV blocks."),
                    ("kv_evicted_blocks", "KV blocks evicted by an attention-score policy (h2o, snapkv).")]
        spec = "spec_decode_num_drafts" in s  # speculative decoding on: vLLM's spec_decode counters too
        if spec:
            counters += [("spec_decode_num_drafts", "Verification steps of speculating sequences."),
                         ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
                         ("spec_decode_num_accepted_tokens", "Draft tokens accepted.")]
        if "kv_blocks_loaded" in s:  # a KV connector (core/kv_connector.py)
            from turbollm.core.kv_connector import GAUGES, STAT_DOCS, TRANSFER_BUCKETS, TRANSFER_HISTOGRAM

            counters += [(k, d) for k, d in STAT_DOCS.items() if k not in GAUGES]
            for name in GAUGES:
                g = GaugeMetricFamily(P + name, STAT_DOCS[name], labels=labels)
                g.add_metric([self.model_name], float(s[name]))
                yield g
            hist = s[TRANSFER_HISTOGRAM]
            h = HistogramMetricFamily(P + TRANSFER_HISTOGRAM, "Seconds of each KV transfer: a sequence's blocks "
                                      "loaded, a prefill instance's hand-off written.", labels=labels)
            cumulative = list(itertools.accumulate(hist["counts"]))
            h.add_metric([self.model_name], [(repr(b), c) for b, c in zip(TRANSFER_BUCKETS, cumulative)]
                         + [("+Inf", cumulative[-1])], hist["sum"])
            yield h
        for name, doc in counters:
            c = CounterMetricFamily(P + name, doc, labels=labels)
            c.add_metric([self.model_name], float(s[name]))
            yield c
        if spec:
            c = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
                                    "position in the draft.", labels=labels + ["position"])
            for pos, value in enumerate(s["spec_decode_accepted_per_pos"]):
                c.add_metric([self.model_name, str(pos)], float(value))
            yield c


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        """`engine`: the LLMEngine (for `stats()`)."""
        disable_created_metrics()  # no `*_created` series (process-wide; this is the server process)
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.registry.register(_EngineCollector(engine, model_name))
        r, lab = self.registry, ["model_name"]
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", lab, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", lab, registry=r)
        self.request_success = Counter(P + "request_success", "Completions finished, by finish reason.",
                                       lab + ["finished_reason"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to the first token.", lab,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between output tokens.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(P + "request_queue_time_seconds", "Arrival to first scheduling.", lab,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.rejected = Counter(P + "request_rejected", "Requests refused with 503 (queue full).", lab, registry=r)
        # for the dashboard (server/dashboard.py): tokens as they stream, finished requests, and the TTFT and
        # inter-token latencies of the last minutes (the histograms above are since start, in fixed buckets)
        self.tokens_streamed = 0
        self.requests_finished = 0
        self.recent_ttft = LatencyWindow()
        self.recent_itl = LatencyWindow()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per engine request: timestamps of new tokens → TTFT, ITL, e2e, queue time."""

    __slots__ = ("m", "arrival", "last", "tokens")

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.m, self.arrival, self.last, self.tokens = metrics, arrival, None, 0

    def on_output(self, out, now: float) -> None:
        n = sum(len(c.token_ids) for c in out.outputs)
        new = n - self.tokens
        if new <= 0:
            return
        name = self.m.model_name
        self.m.tokens_streamed += new
        if self.last is None:
            self.m.ttft.labels(name).observe(now - self.arrival)
            self.m.recent_ttft.add(now, now - self.arrival)
            sched = (out.metrics or {}).get("first_scheduled_time")
            self.m.queue.labels(name).observe(max(0.0, (sched if sched is not None else now) - self.arrival))
            new -= 1
        if new > 0 and self.last is not None:
            per = (now - self.last) / new
            for _ in range(new):
                self.m.itl.labels(name).observe(per)
            self.m.recent_itl.add(now, per, new)
        self.last, self.tokens = now, n

    def on_finish(self, out, now: float) -> None:
        name = self.m.model_name
        self.m.requests_finished += 1
        self.m.e2e.labels(name).observe(now - self.arrival)
        self.m.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
        self.m.generation_tokens.labels(name).inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            self.m.request_success.labels(name, c.finish_reason or "abort").inc()

    def on_unfinished(self, n: int, reason: str) -> None:
        """A request whose stream ended before its final output (the client disconnected: "abort"; the engine
        failed it: "error"): its n completions are counted under that finish reason."""
        self.m.request_success.labels(self.m.model_name, reason).inc(n)
