"""`turbollm bench kernels`: the quantized matmuls per kernel form, type, shape and row count, against
this CPU's measured ceilings, side by side in one run.

Ceilings, measured first (same threads):
- instruction peaks: a register-only loop of independent multiply-adds per instruction form (the
  kernels' `peak_gops`: AMX int8 tile products, vpdpbusd zmm for int8 on AVX-512 VNNI, maddubs + madd
  for int8 on AVX2, vdpbf16ps, fp32 FMA), what the arithmetic units do with no memory traffic at all
  (best of two half-second runs: the VM's clock moves);
- library rates: PyTorch's int8 x int8 -> int32 `_int_mm`, bf16 and fp32 `linear` at 256 rows on the
  first shape (oneDNN / MKL: on CPUs with AMX tiles these use them, which our kernels do not);
- read bandwidth: summing a buffer far larger than the caches.
Each measured product prints its time, G ops/s (2 M N K / t), the weight bytes it read per second
and its share of the instruction peak of what it runs on (the form's int8 loop for the integer paths,
the fp32 FMA loop for dequantize + sgemm) and of the library int8 rate.
Weights are random codes of each type (`kernels.random_weights`), in enough copies to exceed
`--cold-mb` and used in turn, so every call reads its weights from memory as a model's layers do.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

#: the form whose instructions each form's kernels use for their integer products
FORM_PEAK = {"avx2": "int8_avx2", "avx2_tiles": "int8_avx2", "avx512_vnni": "int8_vnni512", "amx": "int8_amx"}
PEAK_LOOPS = ("int8_amx", "int8_vnni512", "int8_avx2", "bf16_avx512", "fp32_avx512", "fp32_avx2")


@dataclass
class KernelRow:
    form: str
    qtype: str
    shape: str  # K->N
    m: int
    path: str  # the kernels' path at this m ("q8", "q8x2", "q16", "dequant")
    ms: float
    gops: float
    weight_gbps: float
    pct_form_peak: float
    pct_library_int8: float


@dataclass
class KernelBenchResult:
    threads: int
    cpu: str
    forms: list[str]
    peaks_gops: dict[str, float]
    library_gops: dict[str, float]
    read_gbps: float
    rows: list[KernelRow] = field(default_factory=list)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), as lscpu prints it."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def library_rates(k: int, n: int, reps: int) -> dict[str, float]:
    """G ops/s of torch's int8 `_int_mm` and bf16 / fp32 `linear` for 256 x k by k x n."""
    m = 256
    g = torch.Generator().manual_seed(0)
    out = {}
    xi = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    wi = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g)
    try:
        out["int8_int_mm"] = 2 * m * k * n / _timed(lambda: torch._int_mm(xi, wi), reps) / 1e9
    except RuntimeError:  # no int8 GEMM in this build
        out["int8_int_mm"] = 0.0
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    xb, wb = x.bfloat16(), w.bfloat16()
    out["bf16_linear"] = 2 * m * k * n / _timed(lambda: F.linear(xb, wb), reps) / 1e9
    out["fp32_linear"] = 2 * m * k * n / _timed(lambda: F.linear(x, w), reps) / 1e9
    return out


def run_kernel_bench(types: list[str], shapes: list[tuple[int, int]], ms: list[int], forms: list[str],
                     path: str, reps: int, cold_mb: int, on_ceilings=None, progress=None) -> KernelBenchResult:
    """The ceilings (`on_ceilings(result)` once measured), then one `KernelRow` per form x type x shape x m
    (`progress(row)` as each is measured)."""
    from gguf import GGMLQuantizationType as T

    from turbollm.benchmarks.physics import measure_read_bandwidth
    from turbollm.kernels import get_kernels
    from turbollm.kernels import quant as Q
    from turbollm.kernels.forms import REPACKING_FORMS, runnable_forms
    from turbollm.kernels.random_weights import random_weight

    mod = get_kernels()
    if mod is None:
        from turbollm.errors import BenchmarkError
        from turbollm.kernels import build_error

        raise BenchmarkError(f"bench kernels needs the C++ kernels: {build_error()}")
    threads = torch.get_num_threads()
    runnable = runnable_forms()
    forms = [f for f in forms if f in runnable]
    res = KernelBenchResult(threads, cpu_name(), forms,
                            {name: max(mod.peak_gops(name, threads, 0.5) for _ in range(2)) for name in PEAK_LOOPS},
                            library_rates(*shapes[0], reps), measure_read_bandwidth())
    if on_ceilings:
        on_ceilings(res)
    lib_int8 = res.library_gops.get("int8_int_mm") or math.nan
    fp32_peak = max(res.peaks_gops.get("fp32_avx512", 0), res.peaks_gops.get("fp32_avx2", 0)) or math.nan
    g = torch.Generator().manual_seed(0)
    for tname in types:
        qtype = T[tname]
        for k, n in shapes:
            base = random_weight(qtype, n, k, g)
            copies = max(1, min(64, (cold_mb << 20) // max(1, base.numel())))
            raw = [base] + [random_weight(qtype, n, k, g) for _ in range(copies - 1)]
            for form in forms:
                if form in REPACKING_FORMS:
                    packed = [Q.repack(w, int(qtype), k, REPACKING_FORMS[form]) for w in raw]
                    if packed[0][1] == int(qtype):
                        continue  # this type has no repacked layout: it runs the avx2 form
                else:
                    packed = [(w, int(qtype)) for w in raw]
                int8_peak = res.peaks_gops.get(FORM_PEAK[form]) or math.nan
                for m in ms:
                    x = torch.randn(m, k, generator=g)
                    state = {"i": 0}

                    def call():
                        state["i"] = (state["i"] + 1) % len(packed)
                        w, qt = packed[state["i"]]
                        Q.ggml_linear(x, w, qt, k, path=path)

                    t = _timed(call, reps)
                    label = Q.call_path(m, packed[0][1], path)
                    gops = 2 * m * n * k / t / 1e9
                    peak = fp32_peak if label == "dequant" else int8_peak  # dequant: fp32 sgemm
                    res.rows.append(KernelRow(form, tname, f"{k}->{n}", m, label, t * 1e3, gops,
                                              base.numel() / t / 1e9, 100 * gops / peak, 100 * gops / lib_int8))
                    if progress:
                        progress(res.rows[-1])
    return res
