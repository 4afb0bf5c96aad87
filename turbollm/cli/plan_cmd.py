"""`turbollm plan MODEL --workload ...`: what an engine configuration will hold in memory, how many requests of
the workload fit at once, and its step times and latencies, predicted (turbollm/planner/) without serving."""

from __future__ import annotations

import argparse
import dataclasses
import json

from turbollm.cli.engine_flags import add_engine_flags, engine_args_from


def add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict an engine configuration's memory, concurrency and latencies on a "
                                    "workload (a short profile of the real engine, cached)")
    p.add_argument("model_name", nargs="?", default=None, metavar="MODEL", help="the model (or --model)")
    add_engine_flags(p)
    p.add_argument("--workload", default="random:256:128",
                   help="random:IN:OUT, sharegpt[:OUT] or azure[:SPEEDUP] (default random:256:128)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests in the workload (default 64)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals at this rate (requests/s; default: all at once; azure: the trace's times)")
    p.add_argument("--max-input-len", type=int, default=1024, help="prompts cut to this many tokens")
    p.add_argument("--max-output-len", type=int, default=256, help="azure: cap on the trace's output length")
    p.add_argument("--data-dir", default=None, help="folder holding sharegpt/ and azure_llm_trace/")
    p.add_argument("--no-profile", action="store_true",
                   help="memory only: do not run the engine's profile (step times need one)")
    p.add_argument("--refresh-profile", action="store_true", help="profile again even if one is cached")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan)


def run_plan(ns: argparse.Namespace) -> int:
    import sys

    from turbollm.errors import BenchmarkError
    from turbollm.loader.model_loader import describe_model
    from turbollm.planner.plan import make_plan, render
    from turbollm.planner.profile import cached_profile, profile
    from turbollm.planner.workload import parse_workload

    if ns.model_name:
        ns.model = ns.model_name
    if ns.request_rate is not None and ns.request_rate <= 0:
        raise BenchmarkError("--request-rate must be > 0")
    args = engine_args_from(ns)
    if args.speculative_config is not None:  # the planner replays plain decoding (planner/simulate.py)
        print("turbollm plan: speculative decoding is not modelled; planned without it", file=sys.stderr)
        args = dataclasses.replace(args, speculative_config=None)
    tok = describe_model(args.model, quantization=args.quantization).tokenizer
    wl = parse_workload(ns.workload, tok, ns.num_prompts, ns.max_input_len, ns.max_output_len, ns.request_rate,
                        ns.data_dir)
    prof = None
    if not ns.no_profile:
        prof = profile(args, refresh=ns.refresh_profile, log=lambda m: print(m, file=sys.stderr))
    elif not ns.refresh_profile:
        prof = cached_profile(args)
    plan = make_plan(args, wl, prof)
    print(json.dumps(plan.to_dict(), indent=1) if ns.json else render(plan))
    return 0
