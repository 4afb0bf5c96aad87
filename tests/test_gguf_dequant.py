"""turbollm.formats.ggml_types against gguf-py's numpy reference, bit for bit.

Every comparison is on the float32 bit patterns (so -0.0 vs 0.0 counts as a difference).
Random blocks get their fp16 scale fields overwritten with finite fp16 values (random bytes
would decode to NaN / Inf, whose NaN payloads numpy and torch propagate differently).
"""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from turbollm.errors import ModelFormatError, UnsupportedTensorTypeError
from turbollm.formats import ggml_types as gt

# Byte offsets of the fp16 fields inside one block, per type (F16 is all fp16).
FP16_FIELDS: dict[T, tuple[int, ...]] = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,),
    T.IQ1_S: (0,), T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.TQ1_0: (52,), T.TQ2_0: (64,),
}

ALL_TYPES = sorted(gt.SUPPORTED_TYPES, key=lambda t: t.value)
EXPECTED_SUPPORTED = {
    T.F32, T.F16, T.BF16, T.F64, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
    T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
    T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4,
}


def finite_f16_bits(rng: np.random.Generator, size: int) -> np.ndarray:
    """Random fp16 bit patterns that are never Inf / NaN (zeros and subnormals included)."""
    bits = rng.integers(0, 1 << 16, size=size, dtype=np.uint16)
    exponent_all_ones = (bits & 0x7C00) == 0x7C00
    bits[exponent_all_ones] &= 0xBFFF  # drop the top exponent bit: finite, same sign
    return bits


def random_blocks(qtype: T, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes ``(rows, row_bytes)`` of random blocks with finite fp16 fields."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * blocks_per_row
    if qtype == T.F16:
        return finite_f16_bits(rng, n).view(np.uint8).reshape(rows, -1)
    if qtype == T.F64:  # spread over (and past) the float32 range, to exercise rounding
        values = rng.standard_normal(n) * np.exp2(rng.integers(-160, 140, size=n))
        return values.view(np.uint8).reshape(rows, -1)
    raw = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS.get(qtype, ()):
        raw[:, offset : offset + 2] = finite_f16_bits(rng, n).view(np.uint8).reshape(n, 2)
    if qtype == T.IQ1_M:  # d is spread over the top nibbles of the four scale words
        d = finite_f16_bits(rng, n).astype(np.uint16)
        words = raw[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[:, 48:56] = words.view(np.uint8)
    return raw.reshape(rows, blocks_per_row * type_size)


def reference(raw: np.ndarray, qtype: T) -> torch.Tensor:
    if qtype == T.F64:  # gguf-py has no F64 dequantizer; numpy's rounding cast is the reference
        with np.errstate(over="ignore"):
            ref = raw.view(np.float64).astype(np.float32)
    else:
        with np.errstate(over="ignore"):  # MXFP4's largest exponent overflows to inf, in both
            ref = gguf.quants.dequantize(raw, qtype)
    return torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))


def assert_same_bits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    if not torch.equal(ours.view(torch.int32), ref.view(torch.int32)):
        bad = (ours.view(torch.int32) != ref.view(torch.int32)).nonzero()[:5].tolist()
        raise AssertionError(f"{len(bad)}+ mismatches, first at {bad}: "
                             f"{[ours[tuple(i)].item() for i in bad]} vs {[ref[tuple(i)].item() for i in bad]}")


def test_supported_types() -> None:
    assert gt.SUPPORTED_TYPES == EXPECTED_SUPPORTED
    for t in EXPECTED_SUPPORTED:
        assert gt.is_supported(t) and gt.is_supported(int(t.value))
        assert gt.block_size_bytes(t) == gguf.GGML_QUANT_SIZES[t]
    assert not gt.is_supported(T.Q8_K) and not gt.is_supported(9999)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf(qtype: T) -> None:
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    blocks_per_row = 3 if block_size > 1 else 37
    for rows, seed in ((5, 1), (1, 2), (3, 3)):
        raw = random_blocks(qtype, rows, blocks_per_row, seed=seed + 100 * qtype.value)
        ref = reference(raw, qtype)
        if qtype not in (T.F32, T.BF16):  # those decode every bit pattern exactly, NaNs included
            assert not torch.isnan(ref).any()
        ours = gt.dequantize(torch.from_numpy(raw), qtype, (rows, blocks_per_row * block_size))
        assert_same_bits(ours, ref)


def _gguf_can_quantize(qtype: T) -> bool:
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.quantize(np.zeros((1, block_size), dtype=np.float32), qtype)
    except NotImplementedError:
        return False
    return True


QUANTIZABLE = [t for t in ALL_TYPES if t != T.F64 and _gguf_can_quantize(t)]


def test_quantizable_list() -> None:
    # gguf-py implements quantization only for these; the list guards against silent shrinkage
    assert {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0} <= set(QUANTIZABLE)
    assert T.Q4_K not in QUANTIZABLE  # k-quants and i-quants are dequantize-only in gguf-py


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_round_trip_through_gguf_quantize(qtype: T) -> None:
    rng = np.random.default_rng(qtype.value)
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 7, 3 * max(block_size, 32)
    if qtype in (T.TQ1_0, T.TQ2_0):  # ternary types only represent {-1, 0, 1} * scale
        values = rng.integers(-1, 2, size=(rows, cols)).astype(np.float64)
    else:
        values = rng.standard_normal((rows, cols))
    weights = (values * rng.uniform(0.01, 2.0, size=(rows, 1))).astype(np.float32)
    weights[0, :block_size] = 0.0  # an all-zero block
    packed = gguf.quants.quantize(weights, qtype)
    ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(packed, qtype), dtype=np.float32))
    ours = gt.dequantize(torch.from_numpy(np.ascontiguousarray(packed)), qtype, (rows, cols))
    assert_same_bits(ours, ref)
    assert torch.allclose(ours, torch.from_numpy(weights), atol=0.6, rtol=0.6)  # sanity: it is the data


@pytest.mark.parametrize("qtype", [T.Q8_1, T.Q8_K, T.I8, T.I16, T.I32, T.I64, *(
    [T.Q1_0] if hasattr(T, "Q1_0") else [])], ids=lambda t: t.name)
def test_unsupported_type_raises(qtype: T) -> None:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = torch.zeros(2 * type_size, dtype=torch.uint8)
    with pytest.raises(UnsupportedTensorTypeError) as err:
        gt.dequantize(data, qtype, (1, 2 * block_size), tensor_name="blk.0.ffn_up.weight")
    assert str(err.value) == f"unsupported GGUF type {qtype.name} in tensor blk.0.ffn_up.weight"
    with pytest.raises(UnsupportedTensorTypeError, match="unsupported GGUF type 4242 in tensor x"):
        gt.dequantize(data, 4242, (1, 2), tensor_name="x")


@pytest.mark.parametrize("qtype", [T.F16, T.Q4_0, T.Q5_1, T.Q3_K, T.Q6_K, T.IQ2_S, T.IQ1_M, T.NVFP4],
                         ids=lambda t: t.name)
def test_chunked_equals_single_pass(qtype: T) -> None:
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    blocks_per_row = 5 if block_size > 1 else 160
    rows, cols = 9, 5 * block_size if block_size > 1 else 160
    raw = torch.from_numpy(random_blocks(qtype, rows, blocks_per_row, seed=7))
    whole = gt.dequantize(raw, qtype, (rows, cols), chunk_elements=1 << 30)
    for chunk in (1, block_size * 7, cols * 2 + block_size):  # 1 block, 7 blocks, across rows
        assert_same_bits(gt.dequantize(raw, qtype, (rows, cols), chunk_elements=chunk), whole)
    out = torch.full((rows, cols), 3.0)
    assert gt.dequantize(raw, qtype, (rows, cols), out=out, chunk_elements=block_size * 4) is out
    assert_same_bits(out, whole)
    as_bf16 = gt.dequantize(raw, qtype, (rows, cols), dtype=torch.bfloat16, chunk_elements=block_size * 3)
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16, whole.to(torch.bfloat16))


def test_dequantize_rows_matches_full() -> None:
    rows, cols = 11, 512
    raw = torch.from_numpy(random_blocks(T.Q4_K, rows, 2, seed=11))
    full = gt.dequantize(raw, T.Q4_K, (rows, cols))
    index = torch.tensor([10, 0, 3, 3, -1])
    assert_same_bits(gt.dequantize_rows(raw, T.Q4_K, (rows, cols), index), full[index])
    assert_same_bits(gt.dequantize_rows(raw, T.Q4_K, (rows, cols), slice(2, 9, 3)), full[2:9:3])
    with pytest.raises(IndexError):
        gt.dequantize_rows(raw, T.Q4_K, (rows, cols), [rows])


def test_accepts_typed_and_numpy_inputs() -> None:
    rng = np.random.default_rng(5)
    values = rng.standard_normal((3, 17)).astype(np.float32)
    expect = torch.from_numpy(values)
    assert_same_bits(gt.dequantize(torch.from_numpy(values), T.F32, (3, 17)), expect)
    half = values.astype(np.float16)
    assert_same_bits(gt.dequantize(torch.from_numpy(half), T.F16, (3, 17)), torch.from_numpy(half.astype(np.float32)))
    bf16 = expect.to(torch.bfloat16)
    assert_same_bits(gt.dequantize(bf16, T.BF16, (3, 17)), bf16.to(torch.float32))
    readonly = np.frombuffer(random_blocks(T.Q8_0, 3, 2, seed=5).tobytes(), dtype=np.uint8).reshape(3, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "array is not writable" warning leaks out
        ours = gt.dequantize(readonly, T.Q8_0, (3, 64))
    assert_same_bits(ours, reference(readonly, T.Q8_0))


def test_layout_errors_name_the_tensor() -> None:
    raw = torch.zeros(18 * 4, dtype=torch.uint8)
    with pytest.raises(ModelFormatError, match="tensor t0: Q4_0 shape"):
        gt.dequantize(raw, T.Q4_0, (2, 96), tensor_name="t0")
    with pytest.raises(ModelFormatError, match="tensor t1: rows of 48 elements"):
        gt.dequantize(raw[: 18 * 3], T.Q4_0, (2, 48), tensor_name="t1")


def test_reads_tensors_from_a_gguf_file(tmp_path) -> None:
    rng = np.random.default_rng(9)
    weights = {
        "emb": (rng.standard_normal((5, 64)).astype(np.float32), T.Q8_0),
        "proj": (rng.standard_normal((3, 96)).astype(np.float32), T.Q4_1),
        "norm": (rng.standard_normal(64).astype(np.float32), T.F32),
        "half": (rng.standard_normal((2, 8)).astype(np.float32), T.F16),
    }
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "test")
    for name, (w, qtype) in weights.items():
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    for tensor in reader.tensors:
        shape = tuple(reversed([int(x) for x in tensor.shape]))
        ours = gt.dequantize(tensor.data, tensor.tensor_type, shape, tensor_name=tensor.name)
        assert ours.shape == weights[tensor.name][0].shape
        assert_same_bits(ours, reference(np.asarray(tensor.data), tensor.tensor_type).reshape(shape))


def test_exhaustive_small_code_spaces() -> None:
    """Every fp16 / bf16 pattern, every MXFP4 exponent and every NVFP4 scale code."""
    every_u16 = np.arange(1 << 16, dtype=np.uint16)
    finite_f16 = every_u16[(every_u16 & 0x7C00) != 0x7C00].view(np.uint8)
    assert_same_bits(gt.dequantize(torch.from_numpy(finite_f16), T.F16, (finite_f16.size // 2,)),
                     reference(finite_f16, T.F16))
    all_bf16 = every_u16.view(np.uint8)  # NaN payloads included: the decode is a bit shift
    assert_same_bits(gt.dequantize(torch.from_numpy(all_bf16), T.BF16, (1 << 16,)), reference(all_bf16, T.BF16))

    rng = np.random.default_rng(3)
    mx = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    mx[:, 0] = np.arange(256)
    assert_same_bits(gt.dequantize(torch.from_numpy(mx), T.MXFP4, (256, 32)), reference(mx, T.MXFP4))
    nv = rng.integers(0, 256, size=(64, 36), dtype=np.uint8)
    nv[:, :4] = np.arange(256, dtype=np.uint8).reshape(64, 4)
    assert_same_bits(gt.dequantize(torch.from_numpy(nv), T.NVFP4, (64, 64)), reference(nv, T.NVFP4))
