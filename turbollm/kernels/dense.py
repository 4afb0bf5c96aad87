"""float32 ``x @ W.T (+ bias)`` for the dense weights (linear method "none", GGUF F32 parts, a
dense LM head), W float32 or bfloat16 (the engine's `dtype`, quantization/dense_dtype.py).

Decode steps multiply a few rows of x (one per sequence) by each weight. The sgemm torch ships
reads W at 8-13 GB/s of this machine's ~17 for one row, on one core whatever the thread count, and
at 3.5-8 GB/s for 2 to 8 rows (docs/BENCHMARKS.md), so up to ``dense_max_rows`` (16) rows go to the C++
kernel (csrc/dense_gemv.cpp: tiles of W's rows over torch's threads, each tile visited by every group of
4 rows of x while in cache; a row's result does not depend on the others, the row invariance of a
batch-16 decode);
more rows or other dtypes go from there to ``at::linear`` (a bfloat16 W: oneDNN's bf16 matmul on x rounded to
bfloat16, widened back), and without kernels ``F.linear`` is used, which is also the reference the test holds it to (tests/test_dense_gemv.py). The fused decode step calls the same C++ function, so module path
and fused step stay bit-identical. The pass has an AVX2 and an AVX-512 form (csrc/dense_gemv512.cpp) that give
the same bits, so the CPU alone picks (the AVX-512 one from 12 rows; `dense_linear_form` names one, for tests
and scripts/bench_dense.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turbollm.kernels import cpu_kernels


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    kernels = cpu_kernels()
    if kernels is None:
        return F.linear(x, w, bias)
    flat = x.reshape(-1, x.shape[-1])
    return kernels.dense_linear(flat, w, bias).reshape(*x.shape[:-1], w.shape[0])
