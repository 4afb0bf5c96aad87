"""`turbollm bench ablation MODEL`: the plain baseline, each technique added in the seed's order, and the full
stack less each one, on one workload in one run (turbollm/ablation/study.py).

    turbollm bench ablation smollm2-135m --json abl.json --plot docs/ablation_smollm2.png --doc docs/ABLATION.md
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys


def add_ablation_bench(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("ablation", help="what each technique buys: baseline, techniques added in order, "
                                         "leave-one-out")
    p.add_argument("model", help="catalog name, GGUF file or HF folder")
    p.add_argument("--num-prompts", type=int, default=16, help="requests, all arriving at once (default 16)")
    p.add_argument("--max-input-len", type=int, default=128,
                   help="each ShareGPT prompt cut to this many tokens, after the shared system prompt (default 128)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request, exactly (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every configuration, interleaved (default 3)")
    p.add_argument("--speculative-config", metavar="JSON", default=None,
                   help='the speculation step (default {"method": "ngram", "num_speculative_tokens": 3})')
    p.add_argument("--four-bit", metavar="Q", default=None,
                   help="the 4-bit step's weights (default: a GGUF's own blocks, 'gguf'; int4 for other files)")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GiB",
                   help="K/V memory of every configuration (default: float32 K/V for a quarter of the requests at "
                        "once)")
    p.add_argument("--kv-recent-window", type=int, default=32,
                   help="the INT8 K/V step's newest tokens kept in float16 (default 32)")
    p.add_argument("--ppl-tokens", type=int, default=4096, help="WikiText-2 tokens for each Δppl (default 4096)")
    p.add_argument("--ppl-ctx", type=int, default=512, help="perplexity window (default 512)")
    p.add_argument("--data-dir", default=None, help="folder holding sharegpt/ (default: ../shared/data)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the setting, every run and the summary")
    p.add_argument("--plot", metavar="PNG", default=None, help="the waterfall and leave-one-out chart")
    p.add_argument("--compare", metavar="JSON", default=None,
                   help="an earlier run's --json: print each median and factor now against then (±15%%)")
    p.add_argument("--doc", metavar="MD", default=None,
                   help="put this model's section into MD (replacing its previous section), e.g. docs/ABLATION.md")
    p.set_defaults(func=run_bench_ablation)


def run_bench_ablation(ns: argparse.Namespace) -> int:
    from turbollm.ablation.study import run_ablation
    from turbollm.ablation.report import compare, markdown, plot_waterfall, replace_section
    from turbollm.errors import BenchmarkError

    spec = None
    if ns.speculative_config:
        try:
            spec = json.loads(ns.speculative_config)
        except json.JSONDecodeError as e:
            raise BenchmarkError(f"--speculative-config is not JSON: {e}") from None
        from turbollm.spec_decode.config import parse_speculative_config

        parse_speculative_config(spec)  # a bad field named before anything runs
    previous = None
    if ns.compare:
        try:
            with open(ns.compare) as f:
                previous = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise BenchmarkError(f"--compare {ns.compare}: {e}") from None
    kv = None if ns.kv_cache_memory is None else int(ns.kv_cache_memory * 2**30)
    rep = run_ablation(ns.model, num_prompts=ns.num_prompts, max_input_len=ns.max_input_len,
                       max_tokens=ns.max_tokens, repeats=ns.repeats, spec=spec, four_bit=ns.four_bit,
                       kv_cache_memory=kv, kv_window=ns.kv_recent_window, ppl_tokens=ns.ppl_tokens,
                       ppl_ctx=ns.ppl_ctx, data_dir=ns.data_dir,
                       log=lambda m: print(m, file=sys.stderr, flush=True))
    argv = sys.argv[sys.argv.index("ablation") + 1:] if "ablation" in sys.argv else [ns.model]
    command = "turbollm bench ablation " + " ".join(shlex.quote(a) for a in argv)
    md = markdown(rep, command)
    print(md)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rep.to_dict(), f, indent=1)
    if previous is not None:
        table, ok = compare(previous, rep.to_dict())
        print(f"\nAgainst {ns.compare}:\n\n{table}\n\n" + ("every figure within ±15%" if ok else
                                                         "some figures moved more than 15%"))
    if ns.plot:
        plot_waterfall(rep, ns.plot)
        md = md.rstrip() + f"\n\n![{rep.model} ablation]({ns.plot.rpartition('/')[2]})\n"
    if ns.doc:
        try:
            text = open(ns.doc).read()
        except FileNotFoundError:
            text = "# What each technique buys: the ablation\n"
        with open(ns.doc, "w") as f:
            f.write(replace_section(text, ns.model, md))
    return 0
