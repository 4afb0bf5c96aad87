"""`turbollm eval branches`: each residual branch's output error against the fp32 reference.

What is measured and why: `turbollm/eval/branch_error.py`.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

BRANCHES_HELP = """\
Runs MODEL's reference (default: its weights in fp32) over calibration-style text and, at every
layer, feeds the same residual stream to the reference's and the candidate's attention and MLP
branches. Per branch: relative error |y^ - y|^2 / |y|^2 and gain <y^ - y, y> / <y, y> (negative:
the branch shrinks what it writes). The candidate is a quantization applied at load (int4-g128,
int8, ...) or a quantized folder (GPTQ / AWQ output). Text: --data (default: the ShareGPT prompts,
the calibration corpus of `turbollm quantize`, so an offline method is seen on text it was fitted
on; --data takes other text in the same formats, the WikiText-2 test file excepted as for
calibration), cut into --samples windows of --seq-len tokens spread over it."""


def add_branches(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("branches", help="each residual branch's output error and gain against the fp32 reference",
                        description=BRANCHES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="catalog name, GGUF file, HF folder or hub id (the reference's checkpoint)")
    p.add_argument("--candidate", required=True, metavar="Q|DIR",
                   help="quantization applied to MODEL at load (e.g. int4-g128), or a quantized folder")
    p.add_argument("--reference", default="none", metavar="Q", help="quantization of the reference (default none)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="text: ShareGPT JSON, .jsonl or .txt (default: ../shared/data's ShareGPT prompts)")
    p.add_argument("--samples", type=int, default=8, help="windows of text (default 8)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", metavar="FILE", default=None, help="write the result to FILE")
    p.set_defaults(func=run_branches_cmd)


def eval_branches(ns: argparse.Namespace) -> dict:
    """Run `eval branches` as the flags say; print and return the result record."""
    import torch

    from turbollm.benchmarks.report import write_json
    from turbollm.eval.branch_error import branch_errors, summarize
    from turbollm.cli.eval_ppl_cmd import check_same_tokens, set_eval_threads
    from turbollm.loader import load_model
    from turbollm.quantize.calibration import build_calibration

    set_eval_threads(ns.threads)
    ref = load_model(ns.model, quantization=ns.reference)
    windows = build_calibration(ref.tokenizer, ns.samples, ns.seq_len, ns.data).windows
    as_folder = Path(ns.candidate).is_dir()
    cand = load_model(ns.candidate) if as_folder else load_model(ns.model, quantization=ns.candidate)
    check_same_tokens(cand, ref, ref.tokenizer.decode(windows[0].tolist()))
    print(f"reference {ns.model} ({ref.quantization}), candidate {ns.candidate} ({cand.quantization}); "
          f"{windows.shape[0]} windows of {windows.shape[1]} tokens")
    errors = branch_errors(ref.model, cand.model, windows, progress=not ns.no_progress)
    kinds = list(dict.fromkeys(e.branch for e in errors))
    print(f"{'layer':>5}" + "".join(f"{k + ' rel err':>18}{k + ' gain':>16}" for k in kinds))
    for layer in sorted({e.layer for e in errors}):
        row = {e.branch: e for e in errors if e.layer == layer}
        print(f"{layer:>5}" + "".join(f"{row[k].rel_error:>18.5f}{row[k].gain:>+16.5f}" for k in kinds))
    summary = summarize(errors)
    for kind, s in summary.items():
        print(f"{kind}: mean rel error {s['mean_rel_error']:.5f}, gain mean {s['mean_gain']:+.5f} "
              f"(min {s['min_gain']:+.5f}, max {s['max_gain']:+.5f}), negative in {s['negative_gain_layers']} "
              f"of {s['layers']} layers")
    record = {
        "model": ns.model, "reference": ns.reference, "candidate": ns.candidate, "candidate_quantization": cand.quantization,
        "data": ns.data or "sharegpt (default calibration corpus)", "samples": int(windows.shape[0]),
        "seq_len": int(windows.shape[1]), "summary": summary, "branches": [e.as_dict() for e in errors],
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    write_json(ns.json, record)
    return record


def run_branches_cmd(ns: argparse.Namespace) -> int:
    eval_branches(ns)
    return 0
