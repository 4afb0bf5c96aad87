"""`turbollm bench kv`: KV policies and K/V dtypes side by side on one long prompt (turbollm/benchmarks/kv_bench.py).

    turbollm bench kv -m gemma3-270m --ctx 4096 --kv-policy dense auto
"""

from __future__ import annotations

import argparse
import itertools
import json

from turbollm.cli.engine_flags import add_engine_flags, engine_args_from


def add_kv_bench(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("kv", help="KV policies / K/V dtypes on one long prompt: memory, speed, same outputs")
    add_engine_flags(p, several=("kv_policy", "kv_cache_dtype"))  # each combination runs (default: dense
    # then auto; the dtype auto), the first the reference
    p.add_argument("--ctx", type=int, default=4096, help="prompt tokens (the first ones of WikiText-2)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens decoded after the prompt")
    p.add_argument("--data", default=None, metavar="PATH", help="text file (default: WikiText-2 raw test)")
    p.add_argument("--json", metavar="FILE", default=None, help="write setting and results to FILE")
    p.set_defaults(func=run_bench_kv)


def run_bench_kv(ns: argparse.Namespace) -> int:
    import torch

    from turbollm.benchmarks.kv_bench import run_setting
    from turbollm.benchmarks.report import write_json
    from turbollm.eval.perplexity import load_text

    policies = ns.kv_policy or ["dense", "auto"]
    dtypes = ns.kv_cache_dtype or ["auto"]
    from turbollm.cli.eval_long_cmd import check_recent_window, kv_setting

    def args_for(policy: str, dtype: str):  # the options that apply to this policy and dtype
        setting = kv_setting(policy, dtype, ns.attention_sinks, ns.kv_window, ns.kv_recent_window, ns.kv_budget)
        return engine_args_from(argparse.Namespace(**{**vars(ns), **setting.engine_kwargs()}))

    check_recent_window(ns)
    for policy, dtype in itertools.product(policies, dtypes):  # every name checked before any model loads
        args_for(policy, dtype)
    text = load_text(ns.data)
    setting = {"model": ns.model, "ctx": ns.ctx, "max_tokens": ns.max_tokens, "kv_policies": policies,
               "kv_cache_dtypes": dtypes, "max_num_batched_tokens": ns.max_num_batched_tokens,
               "block_size": ns.block_size or "auto (16; 32 for int8/int4)", "kv_recent_window": ns.kv_recent_window,
               "kv_window": ns.kv_window, "attention_sinks": ns.attention_sinks, "kv_budget": ns.kv_budget,
               "threads": ns.threads or torch.get_num_threads(),
               "quantization": ns.quantization}
    print("setting: " + json.dumps(setting))
    rows, ref = [], None
    for policy, dtype in itertools.product(policies, dtypes):
        run = run_setting(args_for(policy, dtype), policy, dtype, ns.ctx, ns.max_tokens, text)
        row = run.row(ref)
        ref = ref or run
        rows.append({**row, "groups": run.groups})
        print("  " + "  ".join(f"{k}={v}" for k, v in row.items() if v is not None), flush=True)
        print(f"    KV groups: {run.groups}")
    write_json(ns.json, {"setting": setting, "results": rows})
    # a policy that keeps what it attends to (auto, dense) must give the reference's tokens: else exit 1
    from turbollm.core.kv_policy import get_kv_policy

    return 0 if all(r.get("token_exact", True) for r in rows if get_kv_policy(r["policy"]).lossless) else 1
