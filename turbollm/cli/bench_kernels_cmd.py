"""`turbollm bench kernels`: the quantized-matmul kernels per form, type, shape and row count against this
CPU's measured peaks (turbollm/benchmarks/kernel_bench.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from turbollm.kernels.forms import FORMS, REPACKED_TYPES

SHAPES = {"1536x8960": (1536, 8960), "8960x1536": (8960, 1536), "576x1536": (576, 1536), "1536x576": (1536, 576),
          "896x4864": (896, 4864), "4864x896": (4864, 896)}


def add_kernel_bench(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("kernels", help="quantized matmuls per kernel form, type and row count, against this CPU's "
                                        "measured int8 / bf16 / fp32 peaks")
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"],
                   help=f"GGML types (the repacking forms cover {', '.join(REPACKED_TYPES)})")
    p.add_argument("--shapes", nargs="+", default=["1536x8960", "8960x1536"], choices=list(SHAPES),
                   help="K x N (inputs x outputs); defaults: qwen2.5-coder-1.5b's MLP")
    p.add_argument("--m", nargs="+", type=int, default=[1, 16, 64, 256], help="activation rows per call")
    p.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS),
                   help="kernel forms (those this CPU cannot run are left out)")
    p.add_argument("--path", default="fast", choices=["auto", "fast", "q8", "q8x2", "q16", "dequant"],
                   help="quantized-matmul path (default fast: one int8 level, the integer peak's arithmetic)")
    p.add_argument("--reps", type=int, default=7, help="timed calls per row (median)")
    p.add_argument("--cold-mb", type=int, default=256, help="weight copies used in turn (MB), past the caches")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", metavar="FILE", default=None)
    p.set_defaults(func=run_bench_kernels)


def run_bench_kernels(ns: argparse.Namespace) -> int:
    import torch

    from turbollm.benchmarks.kernel_bench import run_kernel_bench

    if ns.threads:
        torch.set_num_threads(ns.threads)
    print(f"== setting ==\n  benchmark  kernels\n  threads    {torch.get_num_threads()}\n  path       {ns.path}\n"
          f"  weights    random codes, {ns.cold_mb} MB of copies used in turn (read from memory)")

    def row(r):
        print(f"  {r.form:12s} {r.qtype:5s} {r.shape:10s} M={r.m:<4d} {r.path:7s} {r.ms:8.3f} ms {r.gops:7.1f} GOP/s "
              f"{r.weight_gbps:6.1f} GB/s  {r.pct_form_peak:5.1f}% of its peak  {r.pct_library_int8:5.1f}% of "
              f"_int_mm", flush=True)

    shapes = [SHAPES[s] for s in ns.shapes]

    def ceilings(res):
        print(f"  cpu        {res.cpu}\n  forms      {', '.join(res.forms)} (runnable here, of those asked)")
        print("== ceilings (same threads) ==")
        for name, v in res.peaks_gops.items():
            print(f"  {name:14s} {v:8.1f} GOP/s   " + ("(not on this CPU)" if not v else "instruction loop, registers only"))
        k, n = shapes[0]
        for name, v in res.library_gops.items():
            print(f"  {name:14s} {v:8.1f} GOP/s   torch, 256 x {k} x {n}")
        print(f"  read           {res.read_gbps:8.1f} GB/s\n== kernels ==", flush=True)

    res = run_kernel_bench(ns.types, shapes, ns.m, ns.forms, ns.path, ns.reps, ns.cold_mb, ceilings, row)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(asdict(res), f, indent=1)
    return 0
