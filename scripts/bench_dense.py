"""Benchmark of the decode-row linear (turbollm/kernels/dense.py), float32 or bfloat16 weights, against F.linear.

For each weight shape (K -> N) and row count M it times ``F.linear`` (the sgemm torch ships; with
``--dtype bfloat16`` oneDNN's bf16 matmul on x rounded to bf16) and ``dense_linear``'s pass in each form this
CPU runs (csrc/dense_gemv.cpp avx2, csrc/dense_gemv512.cpp avx512: the same bits; up to 16 rows, at::linear
beyond) side by side, round-robin, at each thread count. Weights are cold: enough copies to fill 256 MB
are used in turn. GB/s counts the bytes a pass over W reads, GFLOP/s 2*M*N*K/t. Shapes are the decode
matmuls of smollm2-135m and qwen2.5-coder-0.5b (QKV, gate/up, down, LM head).

    python scripts/bench_dense.py --m 1 4 8 --threads 1 2 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from turbollm.kernels import get_kernels

SHAPES = {"576x960": (576, 960), "576x3072": (576, 3072), "1536x576": (1536, 576), "576x49152": (576, 49152),
          "896x1152": (896, 1152), "896x9728": (896, 9728), "4864x896": (4864, 896)}
CACHE_BYTES = 256 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    kernels = get_kernels()
    if kernels is None:
        raise SystemExit("C++ kernels unavailable: dense_linear would be F.linear")
    dtype = getattr(torch, args.dtype)
    forms = ["avx2"] + (["avx512"] if "avx512_vnni" in kernels.kernel_forms() else [])
    gen = torch.Generator().manual_seed(0)
    names = ["F.linear", *forms]
    print(f"{args.dtype} weights; {'K->N':>11} {'M':>3} {'thr':>3}" + "".join(
        f" | {name + ' ms':>11} {'GB/s':>5} {'GF/s':>5}" for name in names) + " | best form over F.linear")
    for sname in args.shapes:
        k, n = SHAPES[sname]
        size = torch.tensor([], dtype=dtype).element_size()
        copies = max(1, -(-CACHE_BYTES // (size * n * k)))
        ws = [torch.randn(n, k, generator=gen).to(dtype) for _ in range(copies)]
        for m in args.m:
            x = torch.randn(m, k, generator=gen)
            fns = {"F.linear": (lambda w: F.linear(x, w)) if dtype == torch.float32 else
                   (lambda w: F.linear(x.to(dtype), w).float())}
            for form in forms:
                fns[form] = lambda w, form=form: kernels.dense_linear_form(x, w, None, form)
            for thr in args.threads:
                torch.set_num_threads(thr)
                times: dict[str, list[float]] = {name: [] for name in fns}
                for name, f in fns.items():  # warm-up
                    f(ws[0])
                for _ in range(args.reps):
                    for name, f in fns.items():  # round-robin: both see the same machine
                        t0 = time.perf_counter()
                        for w in ws:
                            f(w)
                        times[name].append((time.perf_counter() - t0) / copies)
                t = {name: statistics.median(v) for name, v in times.items()}
                row = f"{'':>{len(args.dtype) + 9}}{k:>5}->{n:<5} {m:>3} {thr:>3}"
                for name in fns:
                    row += f" | {t[name] * 1e3:11.3f} {size * n * k / t[name] / 1e9:5.1f} " \
                           f"{2 * m * n * k / t[name] / 1e9:5.1f}"
                print(row + f" | {t['F.linear'] / min(t[f] for f in forms):.2f}x", flush=True)


if __name__ == "__main__":
    main()
