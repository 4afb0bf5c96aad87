"""Benchmark of the tiled attention kernel (csrc/flash_attention.cpp) over a whole prompt, per form of its key step.

For each head configuration (query heads, KV heads, head dim of a catalog model) and prompt length L it runs
``paged_attention`` over one sequence of L new tokens (causal, a paged float16 or float32 cache in blocks of
16) with its key step in each form this CPU runs (``set_attention_isa``: portable, avx2, avx512 — the same
bits), round-robin, at each thread count, and prints the median ms and GFLOP/s (4 * Hq * D * L(L+1)/2: the
visible scores and P V, each a multiply-add per head dim; the masked part of the last key step of each tile
is computed but not counted).

    python scripts/bench_attention.py --models smollm2-135m qwen2.5-coder-0.5b --lens 256 512 --threads 1 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from turbollm.kernels import cpu_flags, get_kernels

HEADS = {"smollm2-135m": (9, 3, 64), "qwen2.5-coder-0.5b": (14, 2, 64), "qwen2.5-coder-1.5b": (12, 2, 128),
         "gemma3-270m": (4, 1, 256)}
BLOCK = 16


def paged_prompt(L: int, hq: int, hk: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """q [L, hq, d], caches [blocks, BLOCK, hk, d] holding the prompt's K/V at shuffled blocks, the table."""
    nb = -(-L // BLOCK)
    q = torch.randn(L, hq, d, generator=gen)
    kc = torch.randn(nb + 1, BLOCK, hk, d, generator=gen).to(dtype)
    vc = torch.randn(nb + 1, BLOCK, hk, d, generator=gen).to(dtype)
    table = (torch.randperm(nb, generator=gen) + 1).view(1, nb)
    return q, kc, vc, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(HEADS)[:3], choices=list(HEADS))
    ap.add_argument("--lens", nargs="+", type=int, default=[256, 512])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--kv-dtype", choices=["float16", "float32"], default="float16")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    kernels = get_kernels()
    if kernels is None:
        raise SystemExit("C++ kernels unavailable")
    forms = ["portable", "avx2"] + (["avx512"] if "avx512f" in cpu_flags().split() else [])
    dtype = getattr(torch, args.kv_dtype)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.kv_dtype} K/V, one sequence, causal; {'model':>19} {'L':>5} {'thr':>3}"
          + "".join(f" | {f + ' ms':>12} {'GF/s':>5}" for f in forms) + " | widest over avx2")
    try:
        for model in args.models:
            hq, hk, d = HEADS[model]
            for L in args.lens:
                q, kc, vc, table = paged_prompt(L, hq, hk, d, dtype, gen)
                qsl, lens = torch.tensor([0, L]), torch.tensor([L])
                flops = 4 * hq * d * L * (L + 1) / 2

                def run() -> None:
                    kernels.paged_attention(q, kc, vc, table, qsl, lens, d ** -0.5, -1, 0.0)

                for thr in args.threads:
                    torch.set_num_threads(thr)
                    times: dict[str, list[float]] = {f: [] for f in forms}
                    for _ in range(args.reps + 1):  # the first round warms up
                        for f in forms:
                            kernels.set_attention_isa(f)
                            t0 = time.perf_counter()
                            run()
                            times[f].append(time.perf_counter() - t0)
                    t = {f: statistics.median(v[1:]) for f, v in times.items()}
                    row = f"{'':>{len(args.kv_dtype) + 27}}{model:>19} {L:>5} {thr:>3}"
                    row += "".join(f" | {t[f] * 1e3:12.3f} {flops / t[f] / 1e9:5.0f}" for f in forms)
                    print(row + f" | {t['avx2'] / t[forms[-1]]:.2f}x", flush=True)
    finally:
        kernels.set_attention_isa("auto")


if __name__ == "__main__":
    main()
