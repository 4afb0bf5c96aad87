"""Prefill/decode hand-off on one host: what moving a prompt's K/V through shared memory costs (issue 48).

    python scripts/kv_p2p_transfer.py [--model qwen2.5-coder-0.5b] [--prompt 2048] [--repeats 3] [--over shm|http]

A producer engine (kv_role kv_producer) prefills a `--prompt`-token WikiText-2 prompt and samples its first token;
a consumer engine (kv_consumer) in the same process takes the hand-off and decodes 8 more tokens. The producer's
pool is in shared memory: its send writes the small hand-off file (the blocks stay where they are, held), the
consumer's load claims the file and copies the blocks straight from the producer's pool into its own (one copy).
It prints, per repeat, the bytes moved, the send and the load in ms and GB/s, the hand-off's rate (bytes over
send + load), and beside them this machine's memcpy rate on the same bytes (numpy, best of 5) — and whether the
consumer's tokens equal one engine's. `--over http`: the producer is a `turbollm serve` process of its own and
the consumer is told the hand-off's file is on another host (a path that does not exist here): its worker fetches
the blocks as a bundle from the producer's server over loopback TCP (the load then includes the HTTP GET, the
server's gather from its pool and the CRC).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def memcpy_gbs(nbytes: int) -> float:
    src = np.random.randint(0, 255, nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="each engine's KV budget (small: the pool's pages are reused from repeat to repeat)")
    ap.add_argument("--over", choices=["shm", "http"], default="shm")
    ns = ap.parse_args()
    if ns.over == "http":
        return over_http(ns)
    from turbollm import LLM, SamplingParams

    buf = tempfile.mkdtemp(prefix="turbollm-kv-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p2p = {"kv_connector": "p2p", "kv_buffer_path": buf}
    kw = {"threads": ns.threads, "kv_cache_memory": int(ns.kv_cache_gib * 2**30) if ns.kv_cache_gib else None}
    producer = LLM(ns.model, kv_transfer_config={**p2p, "kv_role": "kv_producer"}, **kw)
    consumer = LLM(ns.model, kv_transfer_config={**p2p, "kv_role": "kv_consumer"}, **kw)
    single = LLM(ns.model, **kw)
    ids = producer.get_tokenizer().encode(DATA.read_text()[:ns.prompt * 8])
    kv = producer.engine.kv_config
    print(f"setting: model={ns.model} prompt={ns.prompt} tokens (WikiText-2 test), K/V {kv.format_name}, block "
          f"{kv.block_size}, threads={ns.threads}, hand-offs in {buf}; greedy, first token + 8")
    for r in range(ns.repeats):
        prompt = ids[r:r + ns.prompt]  # (each repeat its own prompt: no prefix-cache hit anywhere)
        greedy = dict(temperature=0, ignore_eos=True)
        s0, c0 = producer.engine.stats(), consumer.engine.stats()
        (pout,) = producer.generate([{"prompt_token_ids": prompt}], SamplingParams(
            max_tokens=1, kv_transfer_params={"do_remote_decode": True}, **greedy), use_tqdm=False)
        (dout,) = consumer.generate([{"prompt_token_ids": prompt}], SamplingParams(
            max_tokens=9, kv_transfer_params=pout.kv_transfer_params, **greedy), use_tqdm=False)
        (sout,) = single.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=9, **greedy),
                                  use_tqdm=False)
        s1, c1 = producer.engine.stats(), consumer.engine.stats()
        nbytes = c1["kv_bytes_loaded"] - c0["kv_bytes_loaded"]
        send = s1["kv_save_seconds"] - s0["kv_save_seconds"]
        load = c1["kv_load_seconds"] - c0["kv_load_seconds"]
        mc = memcpy_gbs(nbytes)
        rate = nbytes / (send + load) / 1e9
        written = s1["kv_bytes_saved"] - s0["kv_bytes_saved"]
        print(f"repeat {r}: moved {nbytes / 2**20:.1f} MiB; send {1000 * send:.2f} ms (the hand-off file, "
              f"{written / 1024:.1f} KiB), "
              f"load {1000 * load:.2f} ms ({nbytes / load / 1e9:.2f} GB/s); hand-off {rate:.2f} GB/s = "
              f"{100 * rate / mc:.0f}% of memcpy ({mc:.2f} GB/s on the same bytes); "
              f"tokens equal one engine's: {list(dout.outputs[0].token_ids) == list(sout.outputs[0].token_ids)}")
    for llm in (producer, consumer, single):
        llm.engine.shutdown()


def over_http(ns) -> None:
    import json
    import signal
    import subprocess

    import httpx

    from turbollm import LLM, SamplingParams
    from turbollm.cli.proxy_cmd import wait_for_instances

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    here, there = tempfile.mkdtemp(prefix="turbollm-kv-", dir=shm), tempfile.mkdtemp(prefix="turbollm-kv-", dir=shm)
    port = 8301
    gib = ["--kv-cache-memory", str(ns.kv_cache_gib)] if ns.kv_cache_gib else []
    server = subprocess.Popen([sys.executable, "-m", "turbollm", "serve", ns.model, "--port", str(port), "--threads",
                               str(ns.threads), "--no-webui", "--log-level", "warning", *gib, "--kv-transfer-config",
                               json.dumps({"kv_connector": "p2p", "kv_role": "kv_producer", "kv_buffer_path": there})],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_instances({"producer": [url]}, 900)
        kw = {"threads": ns.threads, "kv_cache_memory": int(ns.kv_cache_gib * 2**30) if ns.kv_cache_gib else None}
        consumer = LLM(ns.model, kv_transfer_config={"kv_connector": "p2p", "kv_role": "kv_consumer",
                                                     "kv_buffer_path": here}, **kw)
        ids = consumer.get_tokenizer().encode(DATA.read_text()[:ns.prompt * 8])
        print(f"setting: model={ns.model} prompt={ns.prompt} tokens, threads={ns.threads}; producer `turbollm serve` "
              f"at {url} (hand-offs in {there}), consumer in this process (buffer {here}), told the hand-off is on "
              "another host: each prompt's blocks as a bundle over loopback TCP")
        for r in range(ns.repeats):
            prompt = ids[r:r + ns.prompt]
            t0 = time.perf_counter()
            ans = httpx.post(url + "/v1/completions", timeout=600, json={
                "model": ns.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True}}).json()
            prefill = time.perf_counter() - t0
            h = ans["kv_transfer_params"]
            local = Path(h["remote_bundle"])  # (as on another host: not this path, the producer's server)
            handoff = {**h, "remote_url": url, "remote_bundle": f"/no-such-path/{local.parent.name}/{local.name}"}
            c0 = consumer.engine.stats()
            (dout,) = consumer.generate([{"prompt_token_ids": prompt}], SamplingParams(
                max_tokens=9, temperature=0, ignore_eos=True, kv_transfer_params=handoff), use_tqdm=False)
            c1 = consumer.engine.stats()
            nbytes = c1["kv_bytes_loaded"] - c0["kv_bytes_loaded"]
            load = c1["kv_load_seconds"] - c0["kv_load_seconds"]
            print(f"repeat {r}: prefill answer {1000 * prefill:.0f} ms; bundle {nbytes / 2**20:.1f} MiB loaded in "
                  f"{1000 * load:.1f} ms ({nbytes / load / 1e9 if load else 0:.2f} GB/s: the server's gather and CRC, the GET over loopback, "
                  f"CRC, copy); fell back: {c1['kv_remote_fallbacks'] - c0['kv_remote_fallbacks']}; memcpy on the same "
                  f"bytes {memcpy_gbs(nbytes):.2f} GB/s")
        consumer.engine.shutdown()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
