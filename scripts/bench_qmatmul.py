"""Benchmark of the quantized-matmul kernels (turbollm/kernels/quant.py).

For each weight type, shape (K -> N: K inputs, N outputs) and token count M it times the q8
path, the q8x2 path (--q8x2), the dequant path and fp32 F.linear on the dequantized weight,
side by side in one run
(round-robin repetitions; median, or --stat min), at each thread count. GB/s counts the weight bytes the
call reads (quantized bytes for the kernels, 4 bytes a weight for fp32); GFLOP/s is 2*M*N*K/t.

By default weights are "cold": enough copies to overflow the L3 cache (32 MiB here) are used
in turn, so the numbers are what a model much larger than the cache sees. --hot uses one copy.

Types: GGML names (Q4_K, Q8_0, ...) and the integer layouts of the int8 / int4 / int3 methods:
``int8`` (per output channel), ``int4-gN`` and ``int3-gN`` (group-wise, group N), random codes.

    python scripts/bench_qmatmul.py --types Q4_K Q6_K --m 1 4 16 --threads 1 2
    python scripts/bench_qmatmul.py --types Q4_0 int4-g128 Q8_0 int8 --m 1 --threads 1 --q16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from turbollm.formats.ggml_types import dequantize
from turbollm.kernels import quant as Q
from turbollm.kernels.quant import ggml_linear, kernel_supported
from turbollm.kernels.random_weights import random_weight

SHAPES = {"1536x8960": (1536, 8960), "8960x1536": (8960, 1536), "576x1536": (576, 1536),
          "896x9728": (896, 9728), "4864x896": (4864, 896)}
CACHE_BYTES = 256 << 20  # bytes of weight copies used in turn when cold (8x the 32 MiB L3)


def bench(fns: dict, reps: int, stat=statistics.median) -> dict:
    """Seconds of each callable (``stat`` of the repetitions), run round-robin after one warm-up."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: stat(v) for name, v in times.items()}


def cycler(items: list):
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]

    return nxt


class Case:
    """One weight type: its tensors for an ``n × k`` weight (a tuple, copied whole for cold runs),
    their dequantized fp32 form, and ``linear(x, tensors, path)``."""

    def __init__(self, name: str):
        self.name = name
        if name == "int8":
            self.qtype, self.block, self.group = Q.INT8_PER_CHANNEL, 32, 0
        elif name.startswith(("int4-g", "int3-g")):
            self.qtype = Q.INT4_GROUPWISE if name.startswith("int4") else Q.INT3_GROUPWISE
            self.group = int(name.split("-g")[1])
            self.block = self.group
        else:
            self.qtype, self.group = T[name], 0
            self.block = GGML_QUANT_SIZES[self.qtype][0]

    def make(self, n: int, k: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
        if self.qtype == Q.INT8_PER_CHANNEL:
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
            scale = torch.rand(n, generator=gen) * 0.01
            return (w, scale), w.float() * scale[:, None]
        if self.qtype in (Q.INT4_GROUPWISE, Q.INT3_GROUPWISE):
            from turbollm.formats.packing import pack_3bit, pack_nibbles

            bits = 4 if self.qtype == Q.INT4_GROUPWISE else 3
            codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=gen)
            packed = (pack_nibbles(codes) if bits == 4 else pack_3bit(codes)).contiguous()
            scales = (torch.rand(n, k // self.group, generator=gen) * 0.01).half()
            zeros = torch.randint(0, 1 << bits, (n, k // self.group), dtype=torch.uint8, generator=gen)
            deq = Q.int4_dequantize if bits == 4 else Q.int3_dequantize
            return (packed, scales, zeros), deq(packed, scales, zeros, self.group)
        w = random_weight(self.qtype, n, k, gen)
        return (w,), dequantize(w, self.qtype, (n, k))

    def linear(self, x: torch.Tensor, ts: tuple, k: int, path: str) -> torch.Tensor:
        if self.qtype == Q.INT8_PER_CHANNEL:
            return Q.int8_linear(x, *ts, path=path)
        if self.qtype == Q.INT4_GROUPWISE:
            return Q.int4_linear(x, *ts, self.group, path=path)
        if self.qtype == Q.INT3_GROUPWISE:
            return Q.int3_linear(x, *ts, self.group, path=path)
        return ggml_linear(x, ts[0], self.qtype, k, path=path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=[1, 4, 16, 64, 512])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=0, help="repetitions (default: by size)")
    ap.add_argument("--hot", action="store_true", help="one weight copy (cache-resident when small)")
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32 F.linear baseline")
    ap.add_argument("--q8x2", action="store_true", help="also time the q8x2 path (two int8 activation levels)")
    ap.add_argument("--q16", action="store_true",
                    help="also time the q16 path (one 16-bit level; q8x2 for the types without 16-bit kernels)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="min: best repetition (what the code can do when other processes leave the cores alone)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    cols = ["q8"] + (["q8x2"] if args.q8x2 else []) + (["q16"] if args.q16 else []) + ["deq"] \
        + ([] if args.no_fp32 else ["fp32"])
    print(f"{'type':9} {'K->N':>10} {'M':>4} {'thr':>3}"
          + "".join(f" | {c + ' ms':>8} {'GB/s':>6} {'GF/s':>6}" for c in cols))
    for tname in args.types:
        case = Case(tname)
        if not kernel_supported(case.qtype):
            print(f"{tname}: no kernel")
            continue
        for sname in args.shapes:
            k, n = SHAPES[sname]
            if k % case.block:
                continue  # rows are not whole blocks (groups) of this type
            t0, wf = case.make(n, k, gen)
            nbytes = sum(t.numel() * t.element_size() for t in t0)
            copies = 1 if args.hot else max(1, -(-CACHE_BYTES // nbytes))
            ws = [t0] + [tuple(t.clone() for t in t0) for _ in range(copies - 1)]
            wfs = [wf] + ([] if args.hot else [wf.clone() for _ in range(max(0, -(-CACHE_BYTES // (4 * n * k)) - 1))])
            nw, nwf = cycler(ws), cycler(wfs)
            for m in args.m:
                x = torch.randn(m, k, generator=gen)
                flops = 2.0 * m * n * k
                reps = args.reps or max(3, min(50, int(2e9 / max(flops, 1e6))))
                fns = {name: (lambda p=path: case.linear(x, nw(), k, p))
                       for name, path in (("q8", "q8"), ("q8x2", "q8x2"), ("q16", "q16"), ("deq", "dequant"))
                       if name in cols}
                if not args.no_fp32:
                    fns["fp32"] = lambda: F.linear(x, nwf())
                for thr in args.threads:
                    torch.set_num_threads(thr)
                    t = bench(fns, reps, min if args.stat == "min" else statistics.median)
                    row = f"{tname:9} {k:>5}->{n:<5} {m:>3} {thr:>3}"
                    for name in cols:
                        b = 4 * n * k if name == "fp32" else nbytes
                        row += f" | {t[name] * 1e3:8.3f} {b / t[name] / 1e9:6.1f} {flops / t[name] / 1e9:6.1f}"
                    print(row, flush=True)


if __name__ == "__main__":
    main()
