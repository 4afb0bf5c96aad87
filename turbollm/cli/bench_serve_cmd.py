"""`turbollm bench serve`: load an OpenAI-compatible server and report TTFT/TPOT/ITL, throughput, goodput."""

from __future__ import annotations

import argparse
import json
import math
import os


def add_serve_bench(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("serve", help="load generator against an OpenAI-compatible server (any URL)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", "-m", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("TURBOLLM_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--dataset", choices=["sharegpt", "random", "azure"], default="sharegpt")
    p.add_argument("--data-dir", default=None,
                   help="folder holding sharegpt/ and azure_llm_trace/ (default: ../shared/data)")
    p.add_argument("--trace", default=None,
                   help="Azure trace CSV (default: DATA_DIR/azure_llm_trace/AzureLLMInferenceTrace_conv.csv)")
    p.add_argument("--trace-speedup", type=float, nargs="+", default=[1.0],
                   help="replay the trace this many times faster; several values: one run each (a rate sweep)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="random: prompt length in tokens")
    p.add_argument("--output-len", type=int, default=128, help="sharegpt/random: max_tokens (ignore_eos)")
    p.add_argument("--max-input-len", type=int, default=1024, help="azure: cap on the trace's context length")
    p.add_argument("--max-output-len", type=int, default=256, help="azure: cap on the trace's output length")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="Poisson arrival rate(s) in requests/s, one run each (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true", help="skip the short untimed request sent before the runs")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--plot", default=None, help="PNG of latency and throughput across rates (needs matplotlib)")
    p.set_defaults(func=run_bench_serve)


def _first_model(base_url: str, api_key: str | None) -> str:
    from turbollm.errors import BenchmarkError

    try:
        import httpx
    except ImportError as e:
        raise BenchmarkError("bench serve needs httpx: pip install httpx (or turbollm[test])") from e

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        r = httpx.get(url, headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise BenchmarkError(f"cannot read the model name from {url}: {e}; pass --model") from e


def run_bench_serve(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from turbollm.benchmarks.datasets import default_data_dir
    from turbollm.benchmarks.serve_bench import (azure_trace_requests, offered_rate, plot_rates,
                                                 random_serve_requests, run_serve_bench, sharegpt_serve_requests)
    from turbollm.errors import BenchmarkError

    if ns.endpoint == "chat" and ns.dataset != "sharegpt":
        raise BenchmarkError("--endpoint chat needs text prompts: use --dataset sharegpt")
    if ns.dataset == "sharegpt":
        reqs = sharegpt_serve_requests(ns.num_prompts, ns.output_len, ns.data_dir)
    elif ns.dataset == "random":
        reqs = random_serve_requests(ns.num_prompts, ns.input_len, ns.output_len, ns.seed)
    else:
        trace = ns.trace or (Path(ns.data_dir) if ns.data_dir else default_data_dir()) / "azure_llm_trace" / \
            "AzureLLMInferenceTrace_conv.csv"
        # one replay per speedup, each at its own offered rate (requests over the replayed span) and with its own
        # random prompts (seed + i): the same prompts again would be prefix-cache hits on the server
        replays = [azure_trace_requests(trace, ns.num_prompts, ns.max_input_len, ns.max_output_len, x, ns.seed + i)
                   for i, x in enumerate(ns.trace_speedup)]
        reqs = replays[0]
    model = ns.model or _first_model(ns.base_url, ns.api_key)
    slo = {"ttft_ms": ns.slo_ttft_ms, "tpot_ms": ns.slo_tpot_ms, "e2e_ms": ns.slo_e2e_ms}
    setting = {"base_url": ns.base_url, "model": model, "endpoint": ns.endpoint, "dataset": ns.dataset,
               "num_prompts": len(reqs), "max_concurrency": ns.max_concurrency, "warmup": not ns.no_warmup,
               "request_rates": ([f"trace x{x}" for x in ns.trace_speedup] if ns.dataset == "azure"
                                 else [str(r) for r in ns.request_rate])}
    print("setting: " + json.dumps(setting))
    if ns.dataset == "azure":
        summaries = []
        for i, (x, replay) in enumerate(zip(ns.trace_speedup, replays)):
            (s,) = run_serve_bench(ns.base_url, model, replay, [math.inf], ns.max_concurrency, False, ns.api_key,
                                   slo, ns.seed, warmup=not ns.no_warmup and i == 0)
            s["trace_speedup"], s["request_rate"] = x, offered_rate(replay)
            summaries.append(s)
    else:
        summaries = run_serve_bench(ns.base_url, model, reqs, ns.request_rate, ns.max_concurrency,
                                    ns.endpoint == "chat", ns.api_key, slo, ns.seed, warmup=not ns.no_warmup)
    for s in summaries:
        label = f"{s['request_rate']:.2f} (trace x{s['trace_speedup']})" if "trace_speedup" in s else \
            str(s["request_rate"])
        if s["request_rate"] == math.inf:  # JSON has no infinity: "inf"; every finite rate stays a number
            s["request_rate"] = "inf"
        print(f"rate {label:>6}: {s['completed']} ok, {s['failed']} failed, "
              f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} out tok/s, "
              f"goodput {s['goodput']:.2f} req/s | TTFT ms p50/p90/p99 {_p(s['ttft_ms'])} | "
              f"TPOT {_p(s['tpot_ms'])} | ITL {_p(s['itl_ms'])}")
        for e in s["errors"]:
            print(f"  error: {e}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"setting": setting, "results": summaries}, f, indent=2)
    if ns.plot:
        if not plot_rates([s for s in summaries if s["request_rate"] != "inf"], ns.plot):
            print("no plot: matplotlib is not installed (pip install 'turbollm[bench]')")
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


def _p(d: dict) -> str:
    return "/".join("-" if d[k] is None else f"{d[k]:.0f}" for k in ("p50", "p90", "p99"))
