"""Prefill/decode disaggregation against one instance on the same cores, over a sweep of request rates (issue 48,
item 6): the Azure conversation trace replayed at several speeds against each setup, back to back.

    python scripts/pd_sweep.py [--model smollm2-135m] [--speedups 0.5 1 2 3] [--num-prompts 60]
        [--max-input-len 8192] [--max-output-len 1024] [--slo-itl-ms 100] [--slo-ttft-ms MS]
        [--chunks 256 ...] [--setups one pd chunks]
        [--plot docs/pd_sweep_smollm2.png] [--json out.json]

Setups: `turbollm serve MODEL` (every core of this process's affinity, chunked prefill), `turbollm serve MODEL
--disaggregate 1:1` (a prefill and a decode instance, the cores split between them, behind the proxy), and with
`--chunks N` one instance whose prefill chunk is N tokens (`--max-num-batched-tokens N`: shorter stalls for the
decoding requests, at a cost in prefill speed). Each is
started, warmed by one untimed replay at the slowest speed (a fresh server's first pages cost far more than its
steady state on this VM), then measured by `turbollm bench serve --dataset azure --trace-speedup ...` (one run per
speed; lengths as the trace gives them unless capped). Printed per setup and rate: completed req/s, TTFT and ITL
p50/p90/p99, and goodput (requests per second whose mean ITL is inside the SLO — and TTFT, if one is given;
DistServe's metric);
then the 1P1D / one-instance ratios of ITL p99 and TTFT p99 at each rate; the PNG draws both setups' TTFT, ITL,
TPOT and goodput against the offered rate. With `--disaggregate`, the decode instance's hand-off counters
(blocks and bytes loaded, load seconds) give the bytes moved per prompt token and the rate reached.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serve_procs import metric_sums, start, stop  # noqa: E402  (scripts/serve_procs.py)


def bench(port: int, ns, speedups: list[float], out: Path, seed: int = 0) -> list[dict]:
    """`bench serve` over the speeds (each replay its own random prompts: seed + i, no prefix-cache hits between
    them; the warm-up takes another seed)."""
    cmd = [sys.executable, "-m", "turbollm", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
           "--seed", str(seed),
           "--dataset", "azure", "--num-prompts", str(ns.num_prompts), "--max-input-len", str(ns.max_input_len),
           "--max-output-len", str(ns.max_output_len), "--slo-tpot-ms", str(ns.slo_itl_ms),
           *(["--slo-ttft-ms", str(ns.slo_ttft_ms)] if ns.slo_ttft_ms else []),
           "--trace-speedup", *map(str, speedups), "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["results"]


def main() -> None:
    from turbollm.benchmarks.kernel_bench import cpu_name
    from turbollm.benchmarks.serve_bench import plot_rates

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--speedups", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0])
    ap.add_argument("--num-prompts", type=int, default=60)
    ap.add_argument("--max-input-len", type=int, default=8192)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--slo-ttft-ms", type=float, default=None, help="(default: none — goodput under the ITL SLO)")
    ap.add_argument("--slo-itl-ms", type=float, default=100)
    ap.add_argument("--chunks", type=int, nargs="*", default=[],
                    help="also one instance with --max-num-batched-tokens N (a smaller prefill chunk), per N")
    ap.add_argument("--setups", nargs="+", choices=["one", "pd", "chunks"], default=["one", "pd", "chunks"],
                    help="which setups to run (default: all)")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"# pd_sweep {time.strftime('%Y-%m-%d %H:%M')}; {platform.node()}; CPU: {cpu_name()}; {cores} cores; "
          f"model {ns.model}; Azure conversation trace, first {ns.num_prompts} requests, input <= {ns.max_input_len}, "
          f"output <= {ns.max_output_len} tokens; SLO: mean ITL {ns.slo_itl_ms:.0f} ms"
          + (f", TTFT {ns.slo_ttft_ms:.0f} ms" if ns.slo_ttft_ms else ""))
    tmp = Path(tempfile.mkdtemp(prefix="pd-sweep-"))
    one_name, pd_name = f"one instance ({cores} threads)", "1P1D (1 core each)"
    setups = {one_name: [ns.model, "--threads", str(cores)]} if "one" in ns.setups else {}
    if "pd" in ns.setups:
        setups[pd_name] = [ns.model, "--disaggregate", "1:1"]
    for n in ns.chunks if "chunks" in ns.setups else []:
        setups[f"one instance ({cores} threads, chunk {n})"] = [ns.model, "--threads", str(cores),
                                                                "--max-num-batched-tokens", str(n)]
    results: dict[str, list[dict]] = {}
    moved = {}
    for i, (name, args) in enumerate(setups.items()):
        port = 8400 + i
        proc = start(args, port, settle=2 if "--disaggregate" in args else 0)
        try:
            bench(port, ns, [min(ns.speedups)], tmp / "warm.json", seed=1000)  # warm-up replay, not shown
            before = metric_sums(port, "turbollm_proxy:instance_kv_") if "--disaggregate" in args else {}
            results[name] = bench(port, ns, ns.speedups, tmp / f"{i}.json")
            if "--disaggregate" in args:
                after = metric_sums(port, "turbollm_proxy:instance_kv_")
                moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        finally:
            stop(proc)
    print("| setup | trace speed | offered req/s | done req/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms "
          "| goodput req/s |")
    print("|---|---:|---:|---:|---|---|---:|")
    for name, runs in results.items():
        for s in runs:
            t, i = s["ttft_ms"], s["itl_ms"]
            print(f"| {name} | {s['trace_speedup']} | {s['request_rate']:.2f} | {s['request_throughput']:.2f} | "
                  f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | {i['p50']:.0f} / {i['p90']:.0f} / "
                  f"{i['p99']:.0f} | {s['goodput']:.2f} |")
    pd = results.get(pd_name)
    for name, one in results.items() if pd else []:
        if name != pd_name:
            print(f"\n1P1D / {name} at each rate: " + "; ".join(
                f"x{a['trace_speedup']}: ITL p99 {b['itl_ms']['p99'] / a['itl_ms']['p99']:.2f}, TTFT p99 "
                f"{b['ttft_ms']['p99'] / a['ttft_ms']['p99']:.2f}, goodput {b['goodput']:.2f} vs {a['goodput']:.2f}"
                for a, b in zip(one, pd)))
    if moved:
        nbytes = moved.get("turbollm_proxy:instance_kv_bytes_loaded_total", 0.0)
        secs = moved.get("turbollm_proxy:instance_kv_load_seconds_total", 0.0)
        blocks = moved.get("turbollm_proxy:instance_kv_blocks_loaded_total", 0.0)
        prompt_tokens = sum(s["prompt_tokens"] for s in results[pd_name])
        print(f"hand-offs during the sweep: {moved.get('turbollm_proxy:instance_kv_bundles_received_total', 0):.0f} "
              f"received, {blocks:.0f} blocks, {nbytes / 2**20:.1f} MiB = {nbytes / max(prompt_tokens, 1):.0f} bytes "
              f"per prompt token, loaded in {secs:.3f} s ({nbytes / secs / 1e9 if secs else 0:.2f} GB/s), "
              f"fallbacks {moved.get('turbollm_proxy:instance_kv_remote_fallbacks_total', 0):.0f}, expired "
              f"{moved.get('turbollm_proxy:instance_kv_handoffs_expired_total', 0):.0f}")
        n = moved.get("turbollm_proxy:instance_kv_bundles_received_total", 0.0)
        if n:  # the step that loads a prompt's blocks is longer by the load: against a decode step (ITL p50)
            itl = sorted(s["itl_ms"]["p50"] for s in pd)[len(pd) // 2]  # (pd: 1P1D's runs)
            print(f"a hand-off's load: {1000 * secs / n:.2f} ms on average = {100 * secs / n * 1000 / itl:.1f}% of a "
                  f"decode step (the decode instance's median ITL p50, {itl:.0f} ms)")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"results": results, "moved": moved}, indent=1))
    if ns.plot:
        plot_rates(results, ns.plot)
        print(f"plot: {ns.plot}")


if __name__ == "__main__":
    main()
