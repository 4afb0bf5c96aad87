"""Greedy parity of prefill/decode disaggregation through the proxy against one instance (issue 48, first line).

    python scripts/pd_parity.py [--models smollm2-135m gemma3-270m] [--kv float16 int8] [--count 32]

For each model and K/V dtype it serves the model alone (`turbollm serve`, 2 threads), sends HumanEval problems
0..count-1 as completions (greedy, 64 tokens, logprobs 1), one at a time, and keeps each answer's text and token
list; then the same through a prefill and a decode instance (`turbollm serve` with the p2p connector, one thread
each) behind `turbollm proxy`; then the prompts a second time through the proxy (the decode instance now takes
each prompt's start from its own prefix cache and loads only the rest). It prints, per setting, how many answers
are equal token for token (and in text), the first difference if any, and the hand-off counters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from serve_procs import metric_sums, start, stop  # noqa: E402  (scripts/serve_procs.py)


def _answers(port: int, model: str, prompts: list[str]) -> list[tuple[str, list[str]]]:
    out = []
    for p in prompts:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=600, json={
            "model": model, "prompt": p, "max_tokens": 64, "temperature": 0, "logprobs": 1})
        r.raise_for_status()
        c = r.json()["choices"][0]
        out.append((c["text"], c["logprobs"]["tokens"]))
    return out


def _metric(port: int, name: str) -> float:
    return metric_sums(port, name).get(name, 0.0)


def main() -> None:
    from turbollm.benchmarks.spec_bench import humaneval_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--kv", nargs="+", default=["float16", "int8"])
    ap.add_argument("--count", type=int, default=32)
    ns = ap.parse_args()
    prompts = humaneval_prompts("humaneval", None, ns.count)
    print(f"setting: HumanEval 0..{ns.count - 1}, greedy, 64 tokens, one request at a time; one instance (2 threads) "
          f"against a prefill and a decode instance (1 thread each) behind turbollm proxy, twice")
    for model in ns.models:
        for kv in ns.kv:
            flags = [model, "--kv-cache-dtype", kv]
            single = start(flags, 8201)
            try:
                want = _answers(8201, model, prompts)
            finally:
                stop(single)
            procs = []
            try:
                for role, port in (("kv_producer", 8203), ("kv_consumer", 8204)):
                    procs.append(start(flags + ["--threads", "1", "--kv-transfer-config", json.dumps(
                        {"kv_connector": "p2p", "kv_role": role})], port))
                procs.append(start(["--prefill", "http://127.0.0.1:8203", "--decode", "http://127.0.0.1:8204"], 8202,
                                    "proxy"))
                rounds, loaded, hits = [], [], []
                for _ in range(2):
                    rounds.append(_answers(8202, model, prompts))
                    loaded.append(_metric(8204, "turbollm:kv_blocks_loaded_total") - sum(loaded))
                    hits.append(_metric(8204, "turbollm:prefix_cache_hits_total") - sum(hits))
                fallbacks = _metric(8202, "turbollm_proxy:prefill_fallbacks_total") + \
                    _metric(8204, "turbollm:kv_remote_fallbacks_total")
                remote = _metric(8202, "turbollm_proxy:prefilled_remotely_total")
            finally:
                for p in reversed(procs):
                    stop(p)
            for r, got in enumerate(rounds):
                tok = sum(g[1] == w[1] for g, w in zip(got, want))
                text = sum(g[0] == w[0] for g, w in zip(got, want))
                first = next((i for i, (g, w) in enumerate(zip(got, want)) if g[1] != w[1]), None)
                where = ""
                if first is not None:
                    pairs = zip(got[first][1] + [None], want[first][1] + [None])
                    token = next(j for j, (a, b) in enumerate(pairs) if a != b)
                    where = f"; first difference: problem {first}, token {token}"
                print(f"{model} K/V {kv} round {r + 1}: tokens equal {tok}/{len(prompts)}, text equal "
                      f"{text}/{len(prompts)}{where}; decode instance: {loaded[r]:.0f} blocks loaded, "
                      f"{hits[r]:.0f} prompt tokens from its own prefix cache")
            print(f"{model} K/V {kv}: prefilled on the prefill instance {remote:.0f}, fallbacks {fallbacks:.0f}")


if __name__ == "__main__":
    main()
