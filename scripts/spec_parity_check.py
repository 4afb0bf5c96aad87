"""Token-exactness of speculative decoding on the parity prompts (turbollm/eval/prompts.py): each
prompt, 128 greedy tokens, with no speculation and with each given config, batch 1; prints whether
each config's tokens equal the plain engine's, and its acceptance.

    python scripts/spec_parity_check.py MODEL CONFIG_JSON [CONFIG_JSON ...]
"""

from __future__ import annotations

import json
import sys

from turbollm import LLM, SamplingParams
from turbollm.eval.prompts import PARITY_PROMPTS


def main() -> int:
    model, configs = sys.argv[1], [json.loads(c) for c in sys.argv[2:]]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    prompts = list(PARITY_PROMPTS.values())
    ok = True
    base = None
    for config in [None] + configs:
        llm = LLM(model, threads=2, kv_cache_memory=256 << 20, speculative_config=config)
        tokens = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        if base is None:
            base = tokens
            continue
        same = tokens == base
        ok &= same
        print(f"{model} {json.dumps(config)}: token-exact on {len(prompts)} parity prompts: {same}; "
              f"{llm.engine.scheduler.spec_counts}", flush=True)
        llm.engine.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
