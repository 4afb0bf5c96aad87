"""`turbollm tune MODEL --workload ... --slo ...`: search the engine configuration with the most goodput under an
SLO (turbollm/planner/tuner.py), write it as a config file, draw the Pareto front."""

from __future__ import annotations

import argparse
import json

from turbollm.cli.engine_flags import add_engine_flags, engine_args_from


def add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="find the configuration with the most goodput on a workload under an SLO "
                                    "(planner-pruned, measured on half the workload, checked on the other half)")
    p.add_argument("model_name", nargs="?", default=None, metavar="MODEL", help="the model (or --model)")
    add_engine_flags(p)
    p.add_argument("--workload", default="sharegpt:128", help="random:IN:OUT, sharegpt[:OUT] or azure[:SPEEDUP]")
    p.add_argument("--slo", required=True, help="bounds per request in ms, e.g. 'ttft_p99=3000,itl_p99=250' "
                                                "(ttft, itl = mean time per output token, e2e)")
    p.add_argument("--max-quality-loss", default=None, metavar="PCT",
                   help="allow lossy choices (int8 K/V or weights) within this perplexity increase, e.g. 1%%")
    p.add_argument("--minutes", type=float, default=20.0, help="time budget (default 20)")
    p.add_argument("--num-prompts", type=int, default=48, help="requests (half tune, half held out; default 48)")
    p.add_argument("--max-input-len", type=int, default=512, help="prompts cut to this many tokens")
    p.add_argument("--max-output-len", type=int, default=256, help="azure: cap on the trace's output length")
    p.add_argument("--data-dir", default=None, help="folder holding sharegpt/ and azure_llm_trace/")
    p.add_argument("--top", type=int, default=2, help="planner's best candidates measured for real (default 2)")
    p.add_argument("--out", default="tuned.yaml", help="the winner as a config file (default tuned.yaml)")
    p.add_argument("--plot", default=None, metavar="PNG", help="the Pareto front of every measured run")
    p.add_argument("--json", default=None, metavar="FILE", help="the whole report")
    p.set_defaults(func=run_tune_cmd)


def parse_quality(text: str | None) -> float | None:
    from turbollm.errors import BenchmarkError

    if text is None:
        return None
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise BenchmarkError(f"--max-quality-loss {text!r}: give a percentage (1%) or a fraction (0.01)") from None
    if v < 0:
        raise BenchmarkError("--max-quality-loss must be >= 0")
    return v


def run_tune_cmd(ns: argparse.Namespace) -> int:
    from turbollm.errors import BenchmarkError
    from turbollm.loader.model_loader import describe_model
    from turbollm.planner.slo import parse_slo
    from turbollm.planner.tune_search import plot, run_tune, winner_yaml
    from turbollm.planner.workload import parse_workload

    if ns.model_name:
        ns.model = ns.model_name
    slo = parse_slo(ns.slo)  # every input checked before anything runs
    quality = parse_quality(ns.max_quality_loss)
    if ns.minutes <= 0 or ns.num_prompts < 4 or ns.top < 1:
        raise BenchmarkError("--minutes must be > 0, --num-prompts >= 4 and --top >= 1")
    if ns.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BenchmarkError("--plot needs matplotlib (pip install matplotlib)") from None
    base = engine_args_from(ns)
    tok = describe_model(base.model, quantization=base.quantization).tokenizer
    wl = parse_workload(ns.workload, tok, ns.num_prompts, ns.max_input_len, ns.max_output_len, None, ns.data_dir)
    rep = run_tune(base, wl, slo, ns.minutes, quality, ns.top)
    with open(ns.out, "w") as f:
        f.write(winner_yaml(rep, ns.workload))
    if ns.plot:
        plot(rep, ns.plot)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rep.to_dict(), f, indent=1)
    print(f"winner: {rep.winner.label} -> {ns.out}")
    for m in rep.held_out:
        print(f"held-out goodput {m.goodput:.4g} req/s at {m.rate} req/s: {m.candidate.label}")
    return 0
