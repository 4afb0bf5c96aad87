"""`turbollm bench spec`: speculative decoding per proposer against none, same run (turbollm/benchmarks/spec_bench.py).

    turbollm bench spec -m qwen2.5-coder-1.5b --dataset rewrite --num-prompts 82 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \\
                             '{"method": "suffix", "num_speculative_tokens": 4}' \\
        --batch-sizes 1 16 --k-sweep 1 2 3 4 5 --plot spec.png
"""

from __future__ import annotations

import argparse
import json

from turbollm.cli.engine_flags import add_engine_flags, engine_args_from


def add_spec_bench(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("spec", help="speculative decoding: each proposer against none, same run")
    add_engine_flags(p, speculative=False)
    p.add_argument("--speculative-config", nargs="+", metavar="JSON", required=True,
                   help="one or more speculative configs (vLLM's names), each compared with no speculation")
    p.add_argument("--dataset", choices=["humaneval", "rewrite"], default="humaneval",
                   help="humaneval: the problems' prompts (code completion); rewrite: prompt + canonical solution + "
                        "'# The same function, with its docstring removed:' (input-grounded)")
    p.add_argument("--data-dir", default=None, help="folder holding humaneval/ (default: ../shared/data)")
    p.add_argument("--num-prompts", type=int, default=None, help="the first N problems (default: all 82)")
    p.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per prompt (exactly)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1], metavar="B",
                   help="concurrent requests; 1 runs the prompts one at a time")
    p.add_argument("--k-sweep", type=int, nargs="*", default=[], metavar="K",
                   help="also run each config at batch 1 with K pinned to each of these (adaptive off)")
    p.add_argument("--profile", action="store_true",
                   help="also print the target's step time by rows (1..8, 16): what a verification step costs")
    p.add_argument("--plot", metavar="PNG", default=None, help="speedup against K and against batch size")
    p.add_argument("--json", metavar="FILE", default=None, help="write setting and results to FILE")
    p.set_defaults(func=run_bench_spec)


def run_bench_spec(ns: argparse.Namespace) -> int:
    import torch

    from turbollm.benchmarks.report import write_json
    from turbollm.benchmarks.spec_bench import humaneval_prompts, plot, run_setting, step_cost_profile
    from turbollm.spec_decode.config import parse_speculative_config

    configs = [json.loads(c) if c.strip().startswith("{") else c for c in ns.speculative_config]
    for c in configs:  # every config checked before any model loads
        parse_speculative_config(c)
    args = engine_args_from(argparse.Namespace(**{**vars(ns), "speculative_config": None}))
    prompts = humaneval_prompts(ns.dataset, ns.data_dir, ns.num_prompts)
    setting = {"model": ns.model, "dataset": ns.dataset, "num_prompts": len(prompts), "max_tokens": ns.max_tokens,
               "greedy": True, "batch_sizes": ns.batch_sizes, "k_sweep": ns.k_sweep, "threads": ns.threads or
               torch.get_num_threads(), "quantization": ns.quantization, "kv_cache_dtype": ns.kv_cache_dtype,
               "speculative_configs": configs}
    print("setting: " + json.dumps(setting))
    rows, runs, bases = [], [], {}
    if ns.profile:
        prof = step_cost_profile(args)
        one = prof[1]
        print("target step time by rows (ms, and / 1 row): " +
              ", ".join(f"{r}: {ms:.1f} ({ms / one:.2f}x)" for r, ms in prof.items()))
        setting["step_ms_by_rows"] = prof
    for b in ns.batch_sizes:
        plan = [None] + configs
        if b == 1:
            plan += [{**c, "num_speculative_tokens": k, "adaptive": False} for c in configs for k in ns.k_sweep]
        for config in plan:
            run = run_setting(args, config, prompts, b, ns.max_tokens)
            if config is None:
                bases[b] = run
            runs.append(run)
            row = run.row(bases.get(b) if config is not None else None)
            rows.append(row)
            print("  " + "  ".join(f"{k}={v}" for k, v in row.items() if v is not None), flush=True)
    write_json(ns.json, {"setting": setting, "results": rows})
    if ns.plot and not plot(runs, bases, ns.plot):
        print("no plot: matplotlib is not installed (pip install 'turbollm[bench]')")
    elif ns.plot:
        print(f"plot written to {ns.plot}")
    return 0 if all(r["token_exact"] in (None, True) for r in rows) else 1
