"""Greedy outputs of the parity prompts (turbollm/eval/prompts.py), for comparing commits bit for bit.

    python scripts/greedy_dump.py OUT.json [--models ...] [--backends uni mp] [--max-tokens 64]

Per model and executor: the prompts together (one batch, the fused decode path) and each alone, greedy, with
their logprobs; written as JSON. Run it from two checkouts and compare the files (`--compare A.json B.json`
prints, per model and executor, whether the tokens and logprobs are identical).
"""

from __future__ import annotations

import argparse
import json
import sys

MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"]


def dump(ns) -> None:
    from turbollm import LLM, SamplingParams
    from turbollm.eval.prompts import PARITY_PROMPTS

    prompts = list(PARITY_PROMPTS.values())
    params = SamplingParams(temperature=0, max_tokens=ns.max_tokens, ignore_eos=True, logprobs=0)
    out = {}
    for model in ns.models:
        for backend in ns.backends:
            llm = LLM(model, threads=2, kv_cache_memory=512 << 20, distributed_executor_backend=backend)
            runs = {"batch": llm.generate(prompts, params, use_tqdm=False),
                    "alone": [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]}
            out[f"{model}/{backend}"] = {
                k: [{"tokens": o.outputs[0].token_ids,
                     "logprobs": [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]} for o in v]
                for k, v in runs.items()}
            llm.engine.shutdown()
            print(f"{model}/{backend}: done", flush=True)
    with open(ns.out, "w") as f:
        json.dump(out, f)


def compare(a: str, b: str) -> int:
    with open(a) as f:
        x = json.load(f)
    with open(b) as f:
        y = json.load(f)
    ok = True
    for key in x:
        same = x[key] == y.get(key)
        ok &= same
        print(f"{key}: tokens and logprobs identical: {same}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--backends", nargs="+", default=["uni", "mp"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--compare", nargs=2, metavar="JSON")
    ns = ap.parse_args()
    if ns.compare:
        return compare(*ns.compare)
    dump(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
