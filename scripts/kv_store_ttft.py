"""Prompt caching across restarts: TTFT of a long shared prefix, cold and from the block store (issue 48).

    python scripts/kv_store_ttft.py [--model qwen2.5-coder-0.5b] [--prefix 2048] [--suffix 32] [--max-tokens 32]

Each phase is its own process, so the store is all that survives between them:
  1. cold: an empty store; prompt X = a WikiText-2 prefix + suffix 1 (its blocks are saved);
  2. restart: a new process on that store: X again; and another: Y = the same prefix + suffix 2;
  3. reference: no store at all: Y computed whole.
It prints each TTFT, the ratios cold / restart, whether the greedy outputs equal the cold ones token for token
(X against phase 1, Y against phase 3), and the physics of the load: blocks and bytes read, their GB/s, the
prefill rate it replaces. Then the cap: one process feeds `--cap-prefixes` distinct prefixes through a store
capped at `--cap-mib` and prints the folder's size after each (it must never pass the cap).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def _engine(ns, store: str | None, **kw):
    from turbollm import LLM

    if store:
        kw["kv_transfer_config"] = {"kv_connector": "store", "kv_store_path": store,
                                    "kv_store_max_bytes": ns.cap_mib << 20 if ns.phase == "cap" else 8 << 30}
    return LLM(ns.model, threads=ns.threads, **kw)


def _prompts(llm, ns) -> tuple[list[int], list[list[int]]]:
    text = DATA.read_text()
    ids = llm.get_tokenizer().encode(text[:ns.prefix * 8])
    prefix = ids[:ns.prefix]
    tail = ids[ns.prefix:]
    suffixes = [tail[i * ns.suffix:(i + 1) * ns.suffix] for i in range(2)]
    return prefix, [prefix + s for s in suffixes]


def _timed(engine, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first token, the greedy tokens) of one request alone."""
    from turbollm import SamplingParams

    t0 = time.perf_counter()
    rid = engine.add_request({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                        ignore_eos=True))
    ttft, tokens = None, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                tokens = list(o.outputs[0].token_ids)
                if ttft is None and tokens:
                    ttft = time.perf_counter() - t0
    return ttft, tokens


def run_phase(ns) -> dict:
    store = ns.store if ns.phase != "reference" else None
    llm = _engine(ns, store)
    engine = llm.engine
    prefix, (x, y) = _prompts(llm, ns)
    out: dict = {"phase": ns.phase}
    if ns.phase == "cap":
        text_ids = llm.get_tokenizer().encode(DATA.read_text()[:ns.prefix * 8 * (ns.cap_prefixes + 1)])
        sizes = []
        for i in range(ns.cap_prefixes):
            _timed(engine, text_ids[i * ns.prefix:(i + 1) * ns.prefix] + [13], 1)
            engine.executor.worker.kv_connector.flush()
            sizes.append(sum(p.stat().st_size for p in Path(store).rglob("*.kvb")))
        out["sizes"] = sizes
    else:
        run = {"cold": [("x", x)], "restart-x": [("x", x)], "restart-y": [("y", y)], "reference": [("y", y)]}[ns.phase]
        for name, ids in run:
            before = dict(engine.stats())
            ttft, tokens = _timed(engine, ids, ns.max_tokens)
            after = engine.stats()
            out[name] = {"ttft": ttft, "tokens": tokens, "prompt": len(ids),
                         **{k: after.get(k, 0) - before.get(k, 0) for k in
                            ("kv_blocks_loaded", "kv_bytes_loaded", "kv_load_seconds", "kv_blocks_saved",
                             "kv_bytes_saved", "prefix_cache_hits")}}
    out["kv"] = {"dtype": engine.kv_config.format_name, "block_size": engine.kv_config.block_size}
    llm.engine.shutdown()
    return out


def _phase(ns, phase: str) -> dict:
    cmd = [sys.executable, __file__, "--phase", phase, "--store", ns.store, "--model", ns.model,
           "--prefix", str(ns.prefix), "--suffix", str(ns.suffix), "--max-tokens", str(ns.max_tokens),
           "--threads", str(ns.threads), "--cap-mib", str(ns.cap_mib), "--cap-prefixes", str(ns.cap_prefixes)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"phase {phase} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--cap-mib", type=int, default=64)
    ap.add_argument("--cap-prefixes", type=int, default=8)
    ap.add_argument("--phase", default=None)
    ap.add_argument("--store", default=None)
    ns = ap.parse_args()
    if ns.phase:
        print(json.dumps(run_phase(ns)))
        return
    with tempfile.TemporaryDirectory(prefix="turbollm-kvstore-") as tmp:
        ns.store = str(Path(tmp) / "store")
        print(f"setting: model={ns.model} prefix={ns.prefix} tokens (WikiText-2 test) + {ns.suffix}-token suffixes, "
              f"greedy {ns.max_tokens} tokens, threads={ns.threads}, store in {tmp} (each phase its own process)")
        cold, ref = _phase(ns, "cold"), _phase(ns, "reference")
        warm = {**_phase(ns, "restart-x"), **_phase(ns, "restart-y")}
        print(f"K/V: {cold['kv']['dtype']}, block {cold['kv']['block_size']} tokens")
        print(f"cold       X: TTFT {1000 * cold['x']['ttft']:8.1f} ms ({cold['x']['prompt']} tokens, "
              f"{cold['x']['prompt'] / cold['x']['ttft']:.0f} tok/s prefill); saved {cold['x']['kv_blocks_saved']} "
              f"blocks, {cold['x']['kv_bytes_saved'] / 2**20:.1f} MiB")
        print(f"reference  Y: TTFT {1000 * ref['y']['ttft']:8.1f} ms (no store)")
        for name, base in (("x", cold["x"]), ("y", ref["y"])):
            w = warm[name]
            gbs = w["kv_bytes_loaded"] / w["kv_load_seconds"] / 1e9 if w["kv_load_seconds"] else 0.0
            print(f"restart    {name.upper()}: TTFT {1000 * w['ttft']:8.1f} ms = "
                  f"{base['ttft'] / w['ttft']:.1f}x lower; "
                  f"loaded {w['kv_blocks_loaded']} blocks, {w['kv_bytes_loaded'] / 2**20:.1f} MiB in "
                  f"{1000 * w['kv_load_seconds']:.1f} ms ({gbs:.2f} GB/s, checksums and copies included); "
                  f"prefix-cache hits {w['prefix_cache_hits']} tokens; output equal: {w['tokens'] == base['tokens']}")
        ns.phase = "cap"
        cap = _phase(ns, "cap")
        sizes = [s / 2**20 for s in cap["sizes"]]
        print(f"cap {ns.cap_mib} MiB, {ns.cap_prefixes} distinct {ns.prefix}-token prefixes: folder after each "
              f"(MiB): {' '.join(f'{s:.1f}' for s in sizes)}; max {max(sizes):.1f} "
              f"{'<=' if max(sizes) <= ns.cap_mib else '>'} cap")


if __name__ == "__main__":
    main()
