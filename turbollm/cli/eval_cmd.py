"""`turbollm eval parity` (logits and greedy output against transformers), `eval ppl` (eval_ppl_cmd.py; `--stream`
in eval_long_cmd.py), `eval passkey` (eval_long_cmd.py), `eval branches` (eval_branches_cmd.py) and `eval tp`
(tensor parallelism against one process, turbollm/eval/tp_parity.py)."""

from __future__ import annotations

import argparse
import json
import sys

from turbollm.cli.eval_branches_cmd import add_branches
from turbollm.cli.eval_long_cmd import add_passkey
from turbollm.cli.eval_ppl_cmd import add_ppl


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a model")
    esub = p.add_subparsers(dest="eval_command", metavar="EVAL", required=True)
    par = esub.add_parser("parity", help="logits and greedy parity with Hugging Face transformers")
    par.add_argument("--model", "-m", action="append", required=True, help="model(s) to check")
    par.add_argument("--gen-tokens", type=int, default=32)
    par.add_argument("--quantization", default="none",
                     help="how turbollm holds the weights (default none: the GGUF dequantized to fp32, the very "
                          "weights transformers holds; gguf checks the native-block fast path against it)")
    par.add_argument("--json", default=None, help="write the reports to this JSON file")
    par.set_defaults(func=run_parity_cmd)
    add_ppl(esub)
    add_passkey(esub)
    add_branches(esub)
    tp = esub.add_parser("tp", help="tensor and pipeline parallelism against one process: the same greedy tokens "
                                    "(parity margin rule) on the parity and HumanEval prompts, and each rank's "
                                    "weight bytes")
    tp.add_argument("model", help="catalog name, GGUF file, HF folder or hub id")
    tp.add_argument("--tensor-parallel-size", "-tp", type=int, default=2,
                    help="ranks per pipeline stage (default: 2; give 1 with -pp to check stages alone)")
    tp.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages (default: 1)")
    tp.add_argument("--quantization", default=None, help="weights' linear method (default: the checkpoint's)")
    tp.add_argument("--num-prompts", type=int, default=32, help="HumanEval prompts besides the parity prompts")
    tp.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    tp.add_argument("--data-dir", default=None, help="folder holding humaneval/ (default: ../shared/data)")
    tp.add_argument("--threads", type=int, default=None, help="cores in all (split between the ranks)")
    tp.add_argument("--json", default=None, help="write the report to this JSON file")
    tp.set_defaults(func=run_tp_cmd)


def run_parity_cmd(ns: argparse.Namespace) -> int:
    from turbollm.eval.parity import MARGIN, TOP5_TOL, run_parity
    from turbollm.eval.prompts import PARITY_PROMPTS
    from turbollm.loader import load_model

    reports = []
    for name in ns.model:
        loaded = load_model(name, quantization=ns.quantization)
        rep = run_parity(loaded, PARITY_PROMPTS, ns.gen_tokens)
        reports.append(rep.as_dict())
        print(f"== {name}: {'PASS' if rep.ok else 'FAIL'} ({rep.seconds:.0f} s; margin {MARGIN}, top-5 tol {TOP5_TOL})")
        print(f"  {'prompt':<8}{'tokens':>7}{'confident':>10}{'top1 miss':>10}{'top5 diff':>11}{'batched':>10}"
              f"{'greedy eq':>10}{'1st tie':>8}")
        for p in rep.prompts:
            print(f"  {p.name:<8}{p.num_tokens:>7}{p.confident_positions:>10}{p.top1_mismatches:>10}"
                  f"{p.max_top5_diff:>11.2e}{p.max_top5_diff_batched:>10.2e}{p.greedy_equal_prefix:>10}"
                  f"{str(p.greedy_first_tie):>8}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 0 if all(r["ok"] for r in reports) else 1


def run_tp_cmd(ns: argparse.Namespace) -> int:
    from turbollm.benchmarks.spec_bench import humaneval_prompts
    from turbollm.eval.parity import MARGIN
    from turbollm.eval.prompts import PARITY_PROMPTS
    from turbollm.eval.tp_parity import run_tp_parity

    prompts = dict(PARITY_PROMPTS)
    prompts.update({f"humaneval/{i}": p for i, p in enumerate(humaneval_prompts("humaneval", ns.data_dir,
                                                                                 ns.num_prompts))})
    rep = run_tp_parity(ns.model, prompts, ns.tensor_parallel_size, ns.max_tokens, ns.quantization, ns.threads,
                        ns.pipeline_parallel_size)
    d = rep.as_dict()
    whole = rep.weight_bytes_whole
    print(f"== {ns.model} ({ns.quantization or 'checkpoint'} weights), tensor_parallel_size "
          f"{ns.tensor_parallel_size} x pipeline_parallel_size {ns.pipeline_parallel_size}: "
          f"{'PASS' if rep.ok else 'FAIL'} ({rep.seconds:.0f} s; margin {MARGIN})")
    print(f"  {len(rep.prompts)} prompts x {ns.max_tokens} greedy tokens: {d['token_exact']} token-exact, "
          f"{sum(p.ok for p in rep.prompts)} within the margin rule; max |logprob diff| on equal prefixes "
          f"{max(p.max_logprob_diff for p in rep.prompts):.2e}")
    print(f"  weights: {whole / 1e6:.1f} MB in one process; per rank " +
          ", ".join(f"{b / 1e6:.1f} MB ({b / whole:.2f}x)" for b in rep.weight_bytes_per_rank))
    for p in rep.prompts:
        if p.equal_prefix < p.tokens:
            print(f"  {p.name}: equal for {p.equal_prefix} tokens, first reference near-tie at {p.first_tie}"
                  f" -> {'ok' if p.ok else 'FAIL'}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(d, f, indent=2)
    return 0 if rep.ok else 1
