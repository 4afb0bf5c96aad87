"""`turbollm bench serve`: a load generator for any OpenAI-compatible server (ours, vLLM, ...).

Requests stream (SSE) so every token's arrival is timed: TTFT (first text), ITL (gaps between
text chunks), TPOT ((e2e - TTFT) / (output tokens - 1)), e2e. Output token counts come from
the server's `usage` (`stream_options.include_usage`). Arrivals follow a Poisson process at
`rate` requests/s (inf: all at once) or replay a trace's timestamps; `max_concurrency` caps
requests in flight. Goodput counts the requests per second that meet every SLO given.

Prompts: ShareGPT texts (first N, file order), random token ids (`input_len` each, from a
fixed seed), or an Azure LLM trace (arrival times, context and generated lengths; prompts are
random token ids of the trace's lengths). Requests send `ignore_eos` so output lengths are exact
on servers that honour it (turbollm, vLLM).
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from turbollm.errors import BenchmarkError


@dataclass
class ServeRequest:
    prompt: str | list[int]
    max_tokens: int
    arrival: float | None = None  # seconds from the start (trace replay); None: from the rate


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def sharegpt_serve_requests(num: int, output_len: int, data_dir: str | None = None) -> list[ServeRequest]:
    from turbollm.benchmarks.datasets import load_sharegpt_texts

    return [ServeRequest(t, output_len) for t in load_sharegpt_texts(data_dir, num)]


def random_serve_requests(num: int, input_len: int, output_len: int, seed: int = 0,
                          id_range: tuple[int, int] = (100, 10000)) -> list[ServeRequest]:
    rng = random.Random(seed)
    return [ServeRequest([rng.randrange(*id_range) for _ in range(input_len)], output_len) for _ in range(num)]


def azure_trace_requests(path: str | Path, num: int, max_input_len: int, max_output_len: int, speedup: float = 1.0,
                         seed: int = 0) -> list[ServeRequest]:
    """The first `num` rows of an Azure LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    path = Path(path)
    if not path.is_file():
        raise BenchmarkError(f"trace file not found: {path}")
    rng = random.Random(seed)
    out, t0 = [], None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if len(out) >= num:
                break
            ts = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            t0 = ts if t0 is None else t0
            n_in = max(1, min(int(row["ContextTokens"]), max_input_len))
            n_out = max(1, min(int(row["GeneratedTokens"]), max_output_len))
            out.append(ServeRequest([rng.randrange(100, 10000) for _ in range(n_in)], n_out, (ts - t0) / speedup))
    return out


async def _one(client, url: str, model: str, req: ServeRequest, chat: bool) -> RequestResult:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "stream": True, "temperature": 0,
                            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if chat:
        if not isinstance(req.prompt, str):
            raise BenchmarkError("the chat endpoint needs text prompts (use --dataset sharegpt)")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    res = RequestResult(ok=False)
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                text = "".join((c.get("text") or (c.get("delta") or {}).get("content") or "")
                               for c in chunk.get("choices", []))
                if text:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
        res.ok = last is not None
        if not res.ok:
            res.error = "no text received"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _run(base_url: str, model: str, requests: list[ServeRequest], rate: float, max_concurrency: int | None,
               chat: bool, api_key: str | None, seed: int) -> tuple[list[RequestResult], float]:
    try:
        import httpx
    except ImportError as e:
        raise BenchmarkError("bench serve needs httpx: pip install httpx (or turbollm[test])") from e

    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def run_one(req: ServeRequest) -> RequestResult:
            if sem is None:
                return await _one(client, url, model, req, chat)
            async with sem:
                return await _one(client, url, model, req, chat)

        tasks, start, t = [], time.perf_counter(), 0.0
        for req in requests:
            if req.arrival is not None:
                t = req.arrival
            elif math.isfinite(rate):
                t += rng.expovariate(rate)
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(run_one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _pcts(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = sorted(values)

    def pct(p: float) -> float:
        k = (len(v) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return (v[lo] + (v[hi] - v[lo]) * (k - lo)) * scale

    return {"mean": sum(v) / len(v) * scale, "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float | None]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]

    def good(r: RequestResult) -> bool:
        t = (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        return ((slo.get("ttft_ms") is None or r.ttft * 1000 <= slo["ttft_ms"])
                and (slo.get("tpot_ms") is None or t * 1000 <= slo["tpot_ms"])
                and (slo.get("e2e_ms") is None or r.e2e * 1000 <= slo["e2e_ms"]))

    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tok / duration if duration else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration else 0.0,
        "prompt_tokens": in_tok, "output_tokens": out_tok,
        "goodput": sum(good(r) for r in ok) / duration if duration else 0.0, "slo": slo,
        "ttft_ms": _pcts([r.ttft for r in ok]), "tpot_ms": _pcts(tpot),
        "itl_ms": _pcts([x for r in ok for x in r.itl]), "e2e_ms": _pcts([r.e2e for r in ok]),
    }


def run_serve_bench(base_url: str, model: str, requests: list[ServeRequest], rates: list[float],
                    max_concurrency: int | None = None, chat: bool = False, api_key: str | None = None,
                    slo: dict[str, float | None] | None = None, seed: int = 0,
                    warmup: bool = True) -> list[dict[str, Any]]:
    """One summary per rate (a trace replays its own arrivals: pass one rate).

    With `warmup`, one short untimed request goes first, so the first rate does not pay the
    server's first-request costs.
    """
    out = []
    if warmup and requests:
        first = ServeRequest(requests[0].prompt, min(4, requests[0].max_tokens))
        asyncio.run(_run(base_url, model, [first], math.inf, None, chat, api_key, seed))
    for rate in rates:
        results, duration = asyncio.run(_run(base_url, model, requests, rate, max_concurrency, chat, api_key, seed))
        out.append({"request_rate": rate, "max_concurrency": max_concurrency,
                    **summarize(results, duration, slo or {})})
    return out


def offered_rate(requests: list[ServeRequest]) -> float:
    """Requests per second a trace replay offers: its requests over the span of their arrivals."""
    span = max((r.arrival or 0.0) for r in requests) if requests else 0.0
    return (len(requests) - 1) / span if span > 0 else math.inf


def plot_rates(summaries: list[dict[str, Any]] | dict[str, list[dict[str, Any]]], path: str) -> bool:
    """TTFT, ITL and TPOT p50/p99, throughput and goodput against the request rate, as a PNG — one setup's
    summaries, or several setups' side by side ({name: summaries}); False without matplotlib."""
    from turbollm.benchmarks.report import pyplot

    plt = pyplot()
    if plt is None:
        return False
    setups = summaries if isinstance(summaries, dict) else {"": summaries}
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    for name, runs in setups.items():
        rates = [s["request_rate"] for s in runs]
        tag = f"{name} " if name else ""
        for ax, key in zip(axes[:3], ("ttft_ms", "itl_ms", "tpot_ms")):
            for p, style in (("p50", "--"), ("p99", "-")):
                ax.plot(rates, [s[key][p] for s in runs], style, marker="o", label=tag + p)
            ax.set_ylabel(key)
        axes[3].plot(rates, [s["goodput"] for s in runs], marker="o", label=tag + "goodput (req/s)")
        axes[3].plot(rates, [s["request_throughput"] for s in runs], ":", marker=".", label=tag + "completed req/s")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return True
