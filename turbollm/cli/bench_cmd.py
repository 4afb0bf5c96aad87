"""`turbollm bench`: `load` (load time and resident memory) here; `throughput` and `latency` in bench_perf_cmd,
`kernels` in bench_kernels_cmd."""

from __future__ import annotations

import argparse
import json
import resource
import time

from turbollm.cli.bench_ablation_cmd import add_ablation_bench
from turbollm.cli.bench_kernels_cmd import add_kernel_bench
from turbollm.cli.bench_kv_cmd import add_kv_bench
from turbollm.cli.bench_perf_cmd import add_perf_benches, add_prefix_bench
from turbollm.cli.bench_serve_cmd import add_serve_bench
from turbollm.cli.bench_spec_cmd import add_spec_bench
from turbollm.kernels.forms import FORMS
from turbollm.procfs import rss_bytes


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    load = bsub.add_parser("load", help="load time and resident memory of a model")
    load.add_argument("--model", "-m", default="smollm2-135m")
    load.add_argument("--json", action="store_true")
    load.add_argument("--kernel-form", default=None, choices=list(FORMS),
                      help="the weights' layout after loading (default: as an engine would choose)")
    load.set_defaults(func=run_bench_load)
    add_perf_benches(bsub)
    add_prefix_bench(bsub)
    add_serve_bench(bsub)
    add_spec_bench(bsub)
    add_kv_bench(bsub)
    add_kernel_bench(bsub)
    add_ablation_bench(bsub)


def run_bench_load(ns: argparse.Namespace) -> int:
    import torch

    from turbollm.hub.resolve import resolve_model
    from turbollm.loader import load_model

    from turbollm.kernels.forms import resolve_form
    from turbollm.quantization.base import set_kernel_form

    resolve_model(ns.model)  # pull outside the timed region
    form = resolve_form(ns.kernel_form)
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    loaded = load_model(ns.model)
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    set_kernel_form(loaded.model, form)  # the engine's worker does this after loading
    form_seconds = time.perf_counter() - t1
    rss1 = rss_bytes()
    rec = {
        "model": ns.model, "format": loaded.resolved.format.value, "arch": loaded.config.arch,
        "threads": torch.get_num_threads(), "load_seconds": round(seconds, 2),
        "kernel_form": form, "kernel_form_seconds": round(form_seconds, 2),
        "file_tensor_MB": round(loaded.file_tensor_bytes / 1e6, 1),
        "weights_resident_MB": round(loaded.weight_bytes / 1e6, 1),
        "weights_dtype": loaded.weights_storage,
        "rss_after_load_MB": round(rss1 / 1e6, 1), "rss_delta_MB": round((rss1 - rss0) / 1e6, 1),
        "peak_rss_MB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3, 1),
    }
    if ns.json:
        print(json.dumps(rec))
    else:
        for k, v in rec.items():
            print(f"{k:>22}: {v}")
    return 0
