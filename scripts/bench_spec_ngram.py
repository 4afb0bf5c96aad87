"""First look at greedy n-gram speculation (issue 30, in progress): batch 1, plain engine against
`speculative_config={"method": "ngram", ...}`, one after the other, on "rewrite" prompts built from
HumanEval (prompt + canonical solution + "# The same function, with its docstring removed:"), 128
greedy tokens each, timed end to end (prefill included). Prints tok/s, the speedup, the draft counts
and whether the outputs are identical token for token.

    python scripts/bench_spec_ngram.py [MODEL] [NUM_PROBLEMS] [K]
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

from turbollm import LLM, SamplingParams

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "humaneval" / "HumanEval_0-81.jsonl.gz"


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    k = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    probs = [json.loads(line) for line in gzip.open(DATA, "rt")][:count]
    prompts = [p["prompt"] + p["canonical_solution"] + "\n\n# The same function, with its docstring removed:\n"
               for p in probs]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    print(f"{model}, batch 1, 2 threads, {count} HumanEval rewrite prompts, 128 greedy tokens; ngram {spec}")
    res = {}
    for name, kw in (("plain", {}), ("ngram", {"speculative_config": spec})):
        llm = LLM(model, threads=2, kv_cache_memory=256 << 20, **kw)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        llm.engine.scheduler.spec_counts.update(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0)
        toks, seconds = [], 0.0
        for prompt in prompts:
            t0 = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)
            seconds += time.perf_counter() - t0
            toks.append(out[0].outputs[0].token_ids)
        res[name] = (toks, seconds)
        print(f"  {name}: {sum(map(len, toks)) / seconds:.1f} tok/s end to end", llm.engine.scheduler.spec_counts)
        del llm
    print(f"  speedup {res['plain'][1] / res['ngram'][1]:.2f}x; token-exact: {res['plain'][0] == res['ngram'][0]}")


if __name__ == "__main__":
    main()
