"""The C++ quantized-matmul kernels (kernels/csrc/quant_*.cpp) against their PyTorch references.

- q8 path: equals ``q8_linear_ref`` (dequantized Q8 activations times the exactly decoded W,
  in float64) to ~1e-5 relative (summation order only), and the exact fp32 product to 2e-2 of
  its largest magnitude (the error of 8-bit activations over random data is ~5e-3); q8x2 (two
  int8 levels) the same reference with levels=2 and the exact product to 3e-4; q16 (one 16-bit
  level: blocks of 32 for the 32-block types, of 256 for Q4_K / Q5_K / Q6_K) likewise with
  levels=16, and q8x2's output for the other types (Q2_K, Q3_K); the k-quants' q16 int32 sums do
  not overflow on the largest codes, scales and activations.
- dequant path: the fp32 product up to sgemm rounding; ``ggml_dequantize`` and
  ``ggml_embedding`` bit-exact with the ``formats.ggml_types`` decoders.
- without the compiled module every function returns its reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from turbollm.formats.ggml_types import dequantize, dequantize_rows
from turbollm.kernels import get_quant_kernels
from turbollm.kernels import quant as Q
from turbollm.kernels.quant_activations import q8_linear_ref, quantize_activations_ref
from turbollm.kernels.random_weights import random_weight
from conftest import catalog_model_path

GGML_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
MS = [1, 3, 17, 70]
Q8_REF_RTOL = 1e-5  # q8 kernel vs q8_linear_ref, relative to max |ref|
Q8_EXACT_TOL = 2e-2  # q8 kernel vs exact fp32 product, relative to max |exact|
Q8X2_EXACT_TOL = 3e-4  # q8x2 (two int8 levels): ~100x smaller activation error

# skipped when the kernels cannot be built, failed with the build error in strict mode (conftest)
needs_kernels = pytest.mark.usefixtures("needs_kernels")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def check_q8(y: torch.Tensor, x: torch.Tensor, wd: torch.Tensor, qtype: int, levels: int = 1) -> None:
    levels = Q.levels_for(qtype, levels)
    assert rel_err(y, q8_linear_ref(x, wd, Q.activation_block(qtype), levels)) < Q8_REF_RTOL
    assert rel_err(y, x @ wd.T) < (Q8_EXACT_TOL if levels == 1 else Q8X2_EXACT_TOL)


@needs_kernels
@pytest.mark.parametrize(("block", "levels"), [(32, 1), (32, 2), (32, 16), (256, 1), (256, 2), (256, 16)])
def test_activation_quantization_is_bit_exact(block, levels):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 512, generator=gen) * torch.logspace(-3, 3, 5)[:, None]
    x[1, 256:512] = 0.0  # all-zero blocks (scale 0)
    x[2, 5] = 1e4  # one outlier
    got = get_quant_kernels().quantize_act(x, block, levels)
    for a, b in zip(got, quantize_activations_ref(x, block, levels), strict=True):
        assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("qtype", GGML_TYPES, ids=lambda t: t.name)
def test_ggml_types(qtype):
    gen = torch.Generator().manual_seed(int(qtype))
    n, k = 37, (512 if GGML_QUANT_SIZES[qtype][0] == 256 else 352)  # 352: 8 blocks + 3 (remainder path)
    w = random_weight(qtype, n, k, gen)
    wd = dequantize(w, qtype, (n, k))
    assert Q.kernel_supported(qtype)
    assert torch.equal(Q.ggml_dequantize(w, qtype, k), wd)
    out = torch.empty(n, k)
    assert Q.ggml_dequantize(w, qtype, k, out=out) is out and torch.equal(out, wd)
    ids = torch.tensor([[3, 0, 36], [-1, 7, 3]])
    rows = dequantize_rows(w, qtype, (n, k), ids.reshape(-1)).view(2, 3, k)
    assert torch.equal(Q.ggml_embedding(w, qtype, k, ids), rows)
    for m in MS:
        x = torch.randn(m, k, generator=gen)
        check_q8(Q.ggml_linear(x, w, qtype, k, path="q8"), x, wd, qtype)
        check_q8(Q.ggml_linear(x, w, qtype, k, path="q8x2"), x, wd, qtype, levels=2)
        q16 = Q.ggml_linear(x, w, qtype, k, path="q16")
        check_q8(q16, x, wd, qtype, levels=16)
        if not Q.kernel_supported16(qtype):  # q8x2, bit for bit
            assert torch.equal(q16, Q.ggml_linear(x, w, qtype, k, path="q8x2"))
        torch.testing.assert_close(Q.ggml_linear(x, w, qtype, k, path="dequant"), x @ wd.T, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_int8_per_channel():
    gen = torch.Generator().manual_seed(2)
    n, k = 37, 192
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) * 0.01
    wd = w.float() * scale[:, None]
    assert Q.kernel_supported(Q.INT8_PER_CHANNEL)
    for m in MS:
        x = torch.randn(m, k, generator=gen)
        check_q8(Q.int8_linear(x, w, scale, path="q8"), x, wd, Q.INT8_PER_CHANNEL)
        check_q8(Q.int8_linear(x, w, scale, path="q8x2"), x, wd, Q.INT8_PER_CHANNEL, levels=2)
        check_q8(Q.int8_linear(x, w, scale, path="q16"), x, wd, Q.INT8_PER_CHANNEL, levels=16)
        torch.testing.assert_close(Q.int8_linear(x, w, scale, path="dequant"), x @ wd.T, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("group", [32, 64, 96, 128, 256])
def test_int4_groupwise(group):
    gen = torch.Generator().manual_seed(group)
    # 12 blocks: the kernels' 8-block step (scales spread by a permute for 32/64/128, block by
    # block for 96, whose groups straddle the steps) and the remainder; 256: one scale per step
    n, k = 37, 384 if group < 256 else 768
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.01).half()
    zeros = torch.randint(0, 16, (n, k // group), dtype=torch.uint8, generator=gen)
    wd = Q.int4_dequantize_ref(packed, scales, zeros, group)
    assert torch.equal(Q.int4_dequantize(packed, scales, zeros, group), wd)
    for m in MS:
        x = torch.randn(m, k, generator=gen)
        check_q8(Q.int4_linear(x, packed, scales, zeros, group, path="q8"), x, wd, Q.INT4_GROUPWISE)
        check_q8(Q.int4_linear(x, packed, scales, zeros, group, path="q8x2"), x, wd, Q.INT4_GROUPWISE, levels=2)
        check_q8(Q.int4_linear(x, packed, scales, zeros, group, path="q16"), x, wd, Q.INT4_GROUPWISE, levels=16)
        torch.testing.assert_close(Q.int4_linear(x, packed, scales, zeros, group, path="dequant"), x @ wd.T,
                                   rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int3_groupwise(group):
    """3-bit codes packed 12 bytes per 32 (packing.pack_3bit): N odd, several K, M on both sides of
    the q8 / dequant crossover; the codes take all 8 values, the zero points the whole 0..7."""
    from turbollm.formats.packing import pack_3bit

    gen = torch.Generator().manual_seed(100 + group)
    n = 37
    assert Q.kernel_supported(Q.INT3_GROUPWISE)
    for k in (128, 384, 640):
        if k % group:
            continue
        q = torch.randint(0, 8, (n, k), dtype=torch.uint8, generator=gen)
        packed = pack_3bit(q)
        assert packed.shape == (n, k // 32 * 12)
        scales = (torch.rand(n, k // group, generator=gen) * 0.01).half()
        zeros = torch.randint(0, 8, (n, k // group), dtype=torch.uint8, generator=gen)
        wd = Q.int3_dequantize_ref(packed, scales, zeros, group)
        expected = (q.float().view(n, -1, group) - zeros.float()[..., None]) * scales.float()[..., None]
        assert torch.equal(wd, expected.reshape(n, k))
        assert torch.equal(Q.int3_dequantize(packed, scales, zeros, group), wd)
        for m in (1, 3, 9, 40):
            x = torch.randn(m, k, generator=gen)
            check_q8(Q.int3_linear(x, packed, scales, zeros, group, path="q8"), x, wd, Q.INT3_GROUPWISE)
            check_q8(Q.int3_linear(x, packed, scales, zeros, group, path="q8x2"), x, wd, Q.INT3_GROUPWISE, levels=2)
            check_q8(Q.int3_linear(x, packed, scales, zeros, group, path="q16"), x, wd, Q.INT3_GROUPWISE, levels=16)
            torch.testing.assert_close(Q.int3_linear(x, packed, scales, zeros, group, path="dequant"), x @ wd.T,
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(Q.int3_linear(x, packed, scales, zeros, group), x @ wd.T,
                                       rtol=3e-4, atol=3e-4 * float((x @ wd.T).abs().max()))  # auto
    with pytest.raises(RuntimeError, match="int3 weight must be uint8"):  # int4-sized rows under the int3 id
        get_quant_kernels().dequant(torch.zeros(n, 64, dtype=torch.uint8), Q.INT3_GROUPWISE, 128,
                                    scales[:, :128 // group].contiguous(), zeros[:, :128 // group].contiguous(),
                                    group, None)


@needs_kernels
def test_paths_out_and_leading_dims(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    n, k = 20, 256
    w = random_weight(T.Q4_K, n, k, gen)
    x = torch.randn(2, 50, k, generator=gen)
    q8 = Q.ggml_linear(x, w, T.Q4_K, k, path="q8")
    deq = Q.ggml_linear(x, w, T.Q4_K, k, path="dequant")
    assert q8.shape == (2, 50, n) and rel_err(q8, deq) > 1e-6
    monkeypatch.setattr(Q, "DEFAULT_PATH", "q8")  # what a call naming no path takes
    assert torch.equal(Q.ggml_linear(x, w, T.Q4_K, k), q8)  # 100 tokens, forced to q8
    monkeypatch.setattr(Q, "DEFAULT_PATH", "dequant")
    torch.testing.assert_close(Q.ggml_linear(x[:, :1], w, T.Q4_K, k), deq[:, :1])  # 2 tokens: not q8
    out = torch.empty(2, 50, n)
    assert Q.ggml_linear(x, w, T.Q4_K, k, out=out) is out and torch.equal(out, deq)
    with pytest.raises(ValueError):
        Q.check_path("fastest")
    with pytest.raises(ValueError):
        Q.ggml_linear(x, w, T.Q4_K, k, path="fastest")


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_dequant_path_many_chunks(qtype):
    """N > DEQUANT_CHUNK_ROWS: several chunks, written into column slices of the output."""
    gen = torch.Generator().manual_seed(6)
    n, k = 2 * Q.DEQUANT_CHUNK_ROWS + 45, 256
    w = random_weight(qtype, n, k, gen)
    wd = dequantize(w, qtype, (n, k))
    x = torch.randn(40, k, generator=gen)
    torch.testing.assert_close(Q.ggml_linear(x, w, qtype, k, path="dequant"), x @ wd.T, rtol=1e-5, atol=1e-5)
    check_q8(Q.ggml_linear(x, w, qtype, k, path="q8"), x, wd, qtype)


@needs_kernels
def test_auto_and_fast_thresholds():
    gen = torch.Generator().manual_seed(8)
    n, k = 20, 256
    w = random_weight(T.Q6_K, n, k, gen)
    w8 = random_weight(T.Q8_0, n, k, gen)
    w2 = random_weight(T.Q2_K, n, k, gen)
    assert Q.kernel_supported16(T.Q8_0) and Q.kernel_supported16(T.Q6_K) and not Q.kernel_supported16(T.Q2_K)
    for path, small, limit in (("auto", "q16", Q.Q8X2_MAX_TOKENS), ("fast", "q8", Q.Q8_MAX_TOKENS)):
        for m, expect in ((1, small), (limit, small), (limit + 1, "dequant")):
            x = torch.randn(m, k, generator=gen)
            for wt, qt in ((w, T.Q6_K), (w8, T.Q8_0), (w2, T.Q2_K)):
                assert torch.equal(Q.ggml_linear(x, wt, qt, k, path=path), Q.ggml_linear(x, wt, qt, k, path=expect))
    x = torch.randn(1, k, generator=gen)  # q16 is its own path for Q8_0 and Q6_K, q8x2 for Q2_K
    assert not torch.equal(Q.ggml_linear(x, w8, T.Q8_0, k, path="q16"), Q.ggml_linear(x, w8, T.Q8_0, k, path="q8x2"))
    assert not torch.equal(Q.ggml_linear(x, w, T.Q6_K, k, path="q16"), Q.ggml_linear(x, w, T.Q6_K, k, path="q8x2"))
    assert torch.equal(Q.ggml_linear(x, w2, T.Q2_K, k, path="q16"), Q.ggml_linear(x, w2, T.Q2_K, k, path="q8x2"))


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quant_q16_sums_do_not_overflow(qtype):
    """The largest |scale x code| of each k-quant (Q4_K 63 * 15, Q5_K 63 * 31, Q6_K -128 * -32) against
    activations all at +-32767 (one sign per row): the int32 lane sums reach ~2^31 and must stay exact."""
    n, k = 2, 512
    bs, ts = GGML_QUANT_SIZES[qtype]
    blocks = torch.zeros(n * k // bs, ts, dtype=torch.uint8)
    one = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # float16 1.0
    if qtype == T.Q6_K:  # ql = qh = 0: q - 32 = -32; scales -128; d = 1
        blocks[:, 192:208] = 0x80
        blocks[:, 208:210] = one
    else:  # d = 1, dmin = 1, every 6-bit scale and min 63, every code at its maximum
        blocks[:, 0:2] = one
        blocks[:, 2:4] = one
        blocks[:, 4:] = 0xFF
    w = blocks.reshape(n, -1)
    wd = dequantize(w, qtype, (n, k))
    x = torch.stack([torch.ones(k), -torch.ones(k)])
    check_q8(Q.ggml_linear(x, w, qtype, k, path="q16"), x, wd, qtype, levels=16)


@needs_kernels
def test_inference_mode_and_back():
    """The dequant path's per-thread sgemm runs under the caller's grad / inference mode."""
    gen = torch.Generator().manual_seed(7)
    n, k = Q.DEQUANT_CHUNK_ROWS + 20, 256
    w = random_weight(T.Q4_K, n, k, gen)
    x = torch.randn(40, k, generator=gen)
    with torch.inference_mode():
        a = Q.ggml_linear(x, w, T.Q4_K, k, path="dequant")
    b = Q.ggml_linear(x, w, T.Q4_K, k, path="dequant")
    with torch.inference_mode():
        c = Q.ggml_linear(x, w, T.Q4_K, k, path="dequant")
    assert torch.equal(a, b) and torch.equal(b, c) and not b.is_inference()


def test_fallback_without_kernels(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    n, k = 9, 256
    w = random_weight(T.Q4_K, n, k, gen)
    x = torch.randn(3, k, generator=gen)
    monkeypatch.setattr(Q, "_kernel_module", lambda: None)
    assert not Q.kernel_supported(T.Q4_K)
    wd = dequantize(w, T.Q4_K, (n, k))
    assert torch.equal(Q.ggml_linear(x, w, T.Q4_K, k), F.linear(x, wd))
    assert torch.equal(Q.ggml_dequantize(w, T.Q4_K, k), wd)
    ids = torch.tensor([2, 0])
    assert torch.equal(Q.ggml_embedding(w, T.Q4_K, k, ids), wd[ids])
    w8, s = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen), torch.rand(n, generator=gen)
    assert torch.equal(Q.int8_linear(x, w8, s), Q.int8_linear_ref(x, w8, s))
    pk = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    sc, z = torch.rand(n, 4).half(), torch.randint(0, 16, (n, 4), dtype=torch.uint8)
    assert torch.equal(Q.int4_linear(x, pk, sc, z, 64), Q.int4_linear_ref(x, pk, sc, z, 64))
    p3 = torch.randint(0, 256, (n, k // 32 * 12), dtype=torch.uint8)
    assert torch.equal(Q.int3_linear(x, p3, sc, z, 64), Q.int3_linear_ref(x, p3, sc, z, 64))
    assert torch.equal(Q.int3_dequantize(p3, sc, z, 64), Q.int3_dequantize_ref(p3, sc, z, 64))


REAL_TENSORS = [
    ("smollm2-135m", "blk.0.ffn_down.weight"),  # Q4_1
    ("gemma3-270m", "blk.0.attn_output.weight"),  # Q4_K
    ("gemma3-270m", "blk.0.ffn_down.weight"),  # Q6_K
    ("gemma3-270m", "blk.0.attn_q.weight"),  # Q5_0
    ("gemma3-270m", "blk.0.attn_v.weight"),  # Q8_0
]


@pytest.mark.model
@needs_kernels
@pytest.mark.parametrize(("model", "name"), REAL_TENSORS)
def test_real_tensors(model, name):
    from turbollm.formats.gguf_file import read_gguf

    t = read_gguf(catalog_model_path(model, download=False)).tensors[name]
    n, k = t.shape
    w = torch.from_numpy(t.data.copy()).view(n, -1)
    wd = dequantize(w, t.qtype, (n, k))
    assert torch.equal(Q.ggml_dequantize(w, t.qtype, k), wd)
    gen = torch.Generator().manual_seed(5)
    for m in (1, 17):
        x = torch.randn(m, k, generator=gen)
        check_q8(Q.ggml_linear(x, w, t.qtype, k, path="q8"), x, wd, t.qtype)
        check_q8(Q.ggml_linear(x, w, t.qtype, k, path="q8x2"), x, wd, t.qtype, levels=2)
        check_q8(Q.ggml_linear(x, w, t.qtype, k, path="q16"), x, wd, t.qtype, levels=16)


@needs_kernels
@pytest.mark.parametrize("path", ["q8", "q8x2", "q16"])
@pytest.mark.parametrize("qtype", GGML_TYPES, ids=lambda t: t.name)
def test_rows_do_not_depend_on_the_batch(qtype, path):
    """Row invariance of the small-batch paths: every row's product is bit-identical computed alone and
    among up to 8 rows, at each position of the batch (a row's sum runs in one order whatever the
    number of rows a micro-kernel call takes)."""
    gen = torch.Generator().manual_seed(100 + int(qtype))
    n, k = 37, (512 if GGML_QUANT_SIZES[qtype][0] == 256 else 352)
    w = random_weight(qtype, n, k, gen)
    x = torch.randn(8, k, generator=gen)
    alone = torch.cat([Q.ggml_linear(x[i:i + 1], w, qtype, k, path=path) for i in range(8)])
    for m in (2, 3, 5, 8):
        assert torch.equal(Q.ggml_linear(x[:m], w, qtype, k, path=path), alone[:m]), m
