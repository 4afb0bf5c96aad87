"""The decode-row linear (csrc/dense_gemv.cpp, kernels/dense.py), float32 and bfloat16 weights, against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turbollm.kernels import get_kernels
from turbollm.kernels.dense import dense_linear

kernels = get_kernels()
# skipped when the kernels cannot be built, failed with the build error in strict mode (conftest)
pytestmark = pytest.mark.usefixtures("needs_kernels")


@pytest.mark.parametrize("k", [576, 72, 7])  # 16-wide steps only, steps + remainder, remainder only
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8])  # one pass of 4 rows, two passes, a partial one
def test_dense_linear_matches_f_linear(rows, k):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    n = 300  # several parallel tasks at 2 threads
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for bias in (None, b):
        out = kernels.dense_linear(x, w, bias)
        assert out.shape == (rows, n)
        torch.testing.assert_close(out, F.linear(x, w, bias), rtol=1e-5, atol=1e-5 * k ** 0.5)
        # each output is one row of x against one row of W: independent of the other rows
        torch.testing.assert_close(out[-1:], kernels.dense_linear(x[-1:], w, bias), rtol=0, atol=0)


def test_dense_linear_strided_rows_and_batch_shapes():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 2 * 96, generator=g)
    x = wide[:, :96]  # rows 192 floats apart
    w = torch.randn(40, 96, generator=g)
    torch.testing.assert_close(kernels.dense_linear(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 3, 96, generator=g)  # [B, T, K] through the wrapper
    torch.testing.assert_close(dense_linear(x3, w), F.linear(x3, w), rtol=1e-5, atol=1e-4)


def test_many_rows_and_other_dtypes_take_f_linear():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(50, 64, generator=g)
    x = torch.randn(kernels.dense_max_rows + 1, 64, generator=g)
    assert torch.equal(kernels.dense_linear(x, w, None), F.linear(x, w))
    assert torch.equal(dense_linear(x, w), F.linear(x, w))
    x64, w64 = x.double(), w.double()
    assert torch.equal(kernels.dense_linear(x64, w64, None), F.linear(x64, w64))


@pytest.mark.parametrize("k", [576, 72, 7])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64])  # our pass (up to dense_max_rows), oneDNN's bf16 beyond
def test_bfloat16_weights(rows, k):
    """bfloat16 W: up to 16 rows each weight widened and multiplied by the float32 row (the products exact:
    F.linear on the widened W, to float32 rounding; each row alone the same bits); beyond, x rounded to
    bfloat16 and the result too (oneDNN's bf16 matmul): within bfloat16's rounding of the float32 product."""
    g = torch.Generator().manual_seed(rows * 7 + k)
    n = 300
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    for bias in (None, b):
        out = kernels.dense_linear(x, w, bias)
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        exact = F.linear(x, w.float(), bias)
        if rows <= kernels.dense_max_rows:
            torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5 * k ** 0.5)
            assert torch.equal(out[-1:], kernels.dense_linear(x[-1:], w, bias))  # row invariance
        else:
            scale = (x.abs() @ w.float().abs().T).max()  # bfloat16 keeps 8 bits: ~2**-8 of the terms' size
            assert (out - exact).abs().max() <= 2 ** -7 * scale
            assert not torch.equal(out, exact)  # (the rounding is there: this is not the float32 product)
        assert torch.equal(dense_linear(x.unsqueeze(0), w, bias)[0], out)  # the wrapper: the same call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forms_give_the_same_bits(dtype):
    """The AVX-512 pass (csrc/dense_gemv512.cpp) keeps the AVX2 pass's partial sums lane for lane: the same
    bits for every row count up to 16, shape and tail; run where the CPU has AVX-512 (the AVX2 form is checked
    against F.linear above on every CPU)."""
    if "avx512_vnni" not in kernels.kernel_forms():
        with pytest.raises(RuntimeError, match="lacks AVX-512"):
            kernels.dense_linear_form(torch.randn(1, 16), torch.randn(4, 16), None, "avx512")
        return
    g = torch.Generator().manual_seed(5)
    for k, n in ((576, 300), (72, 37), (7, 5), (1536, 130)):
        w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
        for rows in (1, 2, 3, 4, 5, 8, 13, 16):
            x = torch.randn(rows, k, generator=g)
            for bias in (None, b):
                ref = kernels.dense_linear_form(x, w, bias, "avx2")
                assert torch.equal(kernels.dense_linear_form(x, w, bias, "avx512"), ref), (k, n, rows)
                assert torch.equal(kernels.dense_linear(x, w, bias), ref)
