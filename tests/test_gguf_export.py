"""GGUF export: the block encoders, llama.cpp's mixes, and whole-file export / load round trips.

- encoders: byte-identical to gguf-py (``gguf.quants.quantize``) where it has the type, and -
  when llama-cpp-python is installed - to llama.cpp's own ``ggml_quantize_chunk`` for every
  type (the k-quants included); decode errors in the expected range per type;
- mixes: the types llama.cpp's ``llama_tensor_get_type`` picks (use_more_bits layers, output /
  tied embedding, fallbacks for rows that are not whole 256-blocks);
- export: a tiny synthetic llama GGUF exported to each file type -> every tensor is exactly
  what the encoder gives for the decoded source (or the source bytes where kept), metadata
  and value types carried over, same file as ``llama-quantize`` writes (optional); the
  export loads and generates in turbollm and in llama.cpp; bad input fails before work.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, LlamaFileType
from gguf import GGMLQuantizationType as T

from turbollm.formats.ggml_types import dequantize
from turbollm.formats.gguf_file import read_gguf
from turbollm.quantize import gguf_export
from turbollm.formats.ggml_quantizers import SUPPORTED_TYPES, quantize
from turbollm.quantize.gguf_export import GGUFExportError, UnsupportedExportSourceError, export_gguf
from turbollm.quantize.gguf_mixes import FILE_TYPES, plan_tensor_types

GGUF_PY_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16, T.F16]
K_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
EXPORT_TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K"]


def edge_case_rows(seed: int, cols: int = 512) -> np.ndarray:
    """Gaussian rows plus the blocks that stress an encoder: zeros (signed), ties, spikes, scales."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal((24, cols)) * 0.02,
            rng.standard_normal((4, cols)) * (rng.random((4, cols)) < 0.05),  # sparse, -0.0 included
            rng.integers(-8, 8, (4, cols)) / 4,  # many ties
            rng.standard_t(2, (4, cols)),  # heavy tails
            np.abs(rng.standard_normal((2, cols))), -np.abs(rng.standard_normal((2, cols))),
            rng.standard_normal((4, cols)) * np.exp(rng.uniform(-25, 25, (4, 1)))]
    x = np.concatenate(rows).astype(np.float32)
    x[0, :256] = 0.0
    x[1, :16] = -0.0
    x[2, 7] = 1.0
    return x


# ------------------------------------------------------------------------------ encoders

@pytest.mark.parametrize("qtype", GGUF_PY_TYPES, ids=lambda t: t.name)
def test_encoder_matches_gguf_py(qtype):
    x = edge_case_rows(1)
    with np.errstate(all="ignore"):
        ref = gguf.quants.quantize(x, qtype)
    ref = np.ascontiguousarray(ref).view(np.uint8)  # F16 comes back as float16 values
    assert np.array_equal(quantize(x, qtype), ref.reshape(x.shape[0], -1))


def _ggml_base():
    llama_cpp = pytest.importorskip("llama_cpp")
    lib = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    if not lib.is_file():
        pytest.skip("llama-cpp-python has no libggml-base.so")
    ggml = ctypes.CDLL(str(lib))
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return ggml


@pytest.mark.parametrize("qtype", K_TYPES + [T.Q8_0, T.Q4_0, T.Q5_0], ids=lambda t: t.name)
def test_encoder_matches_llama_cpp(qtype):
    """llama.cpp's reference quantizer (no imatrix), called through llama-cpp-python's libggml."""
    ggml = _ggml_base()
    x = edge_case_rows(2)
    if qtype in (T.Q4_0, T.Q5_0):  # in all-zero blocks C takes +0.0 where gguf-py (and we) take -0.0
        x = x + np.float32(0.0)  # -0.0 -> +0.0
    rows, cols = x.shape
    ref = np.zeros((rows, cols // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]), np.uint8)
    ggml.ggml_quantize_chunk(int(qtype), x.ctypes.data, ref.ctypes.data, 0, rows, cols, None)
    assert np.array_equal(quantize(x, qtype), ref)


#: relative RMSE bounds of decode(encode(x)) on Gaussian weights (measured + ~12%)
ERROR_BOUNDS = {T.Q8_0: 0.0062, T.Q6_K: 0.020, T.Q5_K: 0.041, T.Q5_1: 0.043, T.Q5_0: 0.048,
                T.Q4_K: 0.080, T.Q4_1: 0.088, T.Q4_0: 0.097, T.Q3_K: 0.17, T.Q2_K: 0.33}


def test_decode_error_per_type():
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((64, 1024)).astype(np.float32))
    errors = {}
    for qtype, bound in ERROR_BOUNDS.items():
        y = dequantize(quantize(x, qtype), qtype, x.shape)
        errors[qtype] = float((y - x).pow(2).mean().sqrt() / x.std())
        assert errors[qtype] < bound, (qtype.name, errors[qtype])
    # more bits, less error; a k-quant beats the legacy type of the same width
    chain = [T.Q8_0, T.Q6_K, T.Q5_K, T.Q4_K, T.Q3_K, T.Q2_K]
    assert all(errors[a] < errors[b] for a, b in zip(chain, chain[1:])), errors
    assert errors[T.Q5_K] < errors[T.Q5_0] and errors[T.Q4_K] < errors[T.Q4_0] < errors[T.Q3_K]


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q5_0, T.Q6_K], ids=lambda t: t.name)
def test_requantizing_a_decoded_tensor_is_stable(qtype):
    """Values already on a type's grid come back unchanged (bytes too for the symmetric types)."""
    x = torch.from_numpy(edge_case_rows(4)[3:24])  # (all-zero blocks may flip the sign of d = 0)
    first = quantize(x, qtype)
    y = dequantize(first, qtype, x.shape)
    again = quantize(y, qtype)
    assert torch.equal(dequantize(again, qtype, x.shape), y)
    if qtype != T.Q6_K:  # Q6_K may store the same values with another scale split
        assert np.array_equal(again, first)


def test_encoder_errors():
    with pytest.raises(ValueError, match="not whole Q4_K blocks of 256"):
        quantize(np.zeros((2, 576), np.float32), T.Q4_K, tensor_name="w")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize(np.full((1, 32), np.nan, np.float32), T.Q8_0)
    with pytest.raises(Exception, match="encodable types are .*Q4_K"):
        quantize(np.zeros((1, 256), np.float32), T.IQ2_XS)
    assert {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0} <= SUPPORTED_TYPES


# ------------------------------------------------------------------------------ mixes

def _llama_shapes(n_layer: int, hidden: int, ffn: int, kv: int, tied: bool) -> dict[str, tuple[int, ...]]:
    shapes = {"token_embd.weight": (1000, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (1000, hidden)
    for i in range(n_layer):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (hidden,), p + "ffn_norm.weight": (hidden,),
                       p + "attn_q.weight": (hidden, hidden), p + "attn_k.weight": (kv, hidden),
                       p + "attn_v.weight": (kv, hidden), p + "attn_output.weight": (hidden, hidden),
                       p + "ffn_gate.weight": (ffn, hidden), p + "ffn_up.weight": (ffn, hidden),
                       p + "ffn_down.weight": (hidden, ffn)})
    return shapes


def _meta(n_layer: int, heads: int, kv_heads: int) -> dict:
    return {"general.architecture": "llama", "llama.block_count": n_layer,
            "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads}


def test_mix_q4_k_m_use_more_bits():
    plan = plan_tensor_types(_llama_shapes(16, 512, 1024, 128, tied=False), "Q4_K_M", _meta(16, 8, 2))
    more = {0, 1, 4, 7, 10, 13, 14, 15}  # first/last eighth, every third between
    for i in range(16):
        want = T.Q6_K if i in more else T.Q4_K
        assert plan[f"blk.{i}.attn_v.weight"] == want and plan[f"blk.{i}.ffn_down.weight"] == want, i
        assert plan[f"blk.{i}.attn_q.weight"] == plan[f"blk.{i}.ffn_up.weight"] == T.Q4_K
        assert plan[f"blk.{i}.attn_norm.weight"] is None
    assert plan["output.weight"] == T.Q6_K and plan["token_embd.weight"] == T.Q4_K
    assert plan["output_norm.weight"] is None


def test_mix_other_file_types():
    shapes, meta = _llama_shapes(16, 512, 1024, 128, tied=True), _meta(16, 8, 2)
    q3 = plan_tensor_types(shapes, "Q3_K_M", meta)
    assert [q3[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2)] == [T.Q5_K, T.Q5_K, T.Q4_K]
    assert q3["blk.0.ffn_down.weight"] == T.Q5_K and q3["blk.1.ffn_down.weight"] == T.Q4_K
    assert q3["blk.5.attn_output.weight"] == T.Q4_K and q3["blk.5.attn_q.weight"] == T.Q3_K
    assert q3["token_embd.weight"] == T.Q6_K  # tied to the output: the output's type
    q2 = plan_tensor_types(shapes, "Q2_K", _meta(16, 8, 4))  # GQA 2
    assert q2["blk.3.attn_v.weight"] == T.Q3_K and q2["blk.3.ffn_down.weight"] == T.Q3_K
    assert q2["blk.3.attn_output.weight"] == T.Q3_K and q2["blk.3.attn_q.weight"] == T.Q2_K
    assert plan_tensor_types(shapes, "Q2_K", meta)["blk.3.attn_v.weight"] == T.Q4_K  # GQA 4
    q5 = plan_tensor_types(shapes, "Q5_K_M", meta)
    assert q5["blk.0.attn_v.weight"] == T.Q6_K and q5["blk.2.attn_v.weight"] == T.Q5_K
    q40 = plan_tensor_types(shapes, "q4_0", meta)
    assert q40["token_embd.weight"] == T.Q6_K and q40["blk.3.ffn_down.weight"] == T.Q4_0
    q8 = plan_tensor_types(shapes, "Q8_0", meta)
    assert {v for v in q8.values() if v is not None} == {T.Q8_0}


def test_mix_fallbacks_for_rows_that_are_not_whole_k_blocks():
    """smollm2-135m: 576-wide rows, 1536-wide ffn_down, tied embeddings, 30 layers."""
    plan = plan_tensor_types(_llama_shapes(30, 576, 1536, 192, tied=True), "Q4_K_M", _meta(30, 9, 3))
    assert plan["token_embd.weight"] == T.Q8_0  # output rule: 576 % 256 -> Q8_0
    assert plan["blk.4.attn_q.weight"] == T.Q5_0  # Q4_K -> Q5_0
    assert plan["blk.0.attn_v.weight"] == T.Q8_0  # Q6_K -> Q8_0
    assert plan["blk.0.ffn_down.weight"] == T.Q6_K and plan["blk.4.ffn_down.weight"] == T.Q4_K
    assert plan_tensor_types({"blk.0.ffn_up.weight": (8, 48)}, "Q4_K_M", _meta(1, 1, 1)) == {
        "blk.0.ffn_up.weight": T.F16}  # neither Q4_K nor Q5_0 fits 48


# ------------------------------------------------------------------------------ export

H, FFN, V, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 288, 64, 4, 4, 1, 64


def write_source_gguf(path: Path) -> Path:
    """A 4-layer llama (tied embeddings, 288-wide ffn_down rows) with every metadata value type."""
    w = gguf_export._Writer(str(path), "llama")  # the plain writer cannot store the empty array below
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "▁b"] + [f"x{i}" for i in range(V - 8)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(V)])
    w.add_token_types([2, 3, 3] + [1] * (V - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_file_type(int(LlamaFileType.ALL_F32))
    w.add_uint8("test.u8", 7)
    w.add_int16("test.i16", -3)
    w.add_uint64("test.u64", 1 << 40)
    w.add_float64("test.f64", 0.1)
    w.add_key_value("test.i64s", [1, -2, 1 << 40], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT64)
    w.add_key_value("test.empty", [], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(V, H).astype(np.float16))  # decoded from F16
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(p + "attn_q.weight", quantize(rand(HEADS * HEAD_DIM, H), T.Q8_0), raw_dtype=T.Q8_0)
        w.add_tensor(p + "attn_k.weight", rand(KV_HEADS * HEAD_DIM, H))
        w.add_tensor(p + "attn_v.weight", rand(KV_HEADS * HEAD_DIM, H))
        w.add_tensor(p + "attn_output.weight", rand(H, HEADS * HEAD_DIM))
        w.add_tensor(p + "ffn_gate.weight", rand(FFN, H))
        w.add_tensor(p + "ffn_up.weight", rand(FFN, H))
        w.add_tensor(p + "ffn_down.weight", rand(H, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_source_gguf(tmp_path_factory.mktemp("src") / "tiny-f32.gguf")


@pytest.fixture(scope="module")
def exports(source, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("out")
    return {ft: export_gguf(source, folder / f"tiny-{ft}.gguf", ft, progress=False) for ft in EXPORT_TYPES}


@pytest.mark.parametrize("ftype", EXPORT_TYPES)
def test_export_is_bit_exact_and_follows_the_mix(source, exports, ftype):
    src, out = read_gguf(source), read_gguf(exports[ftype])
    assert list(out.tensors) == list(src.tensors)
    plan = plan_tensor_types({n: t.shape for n, t in src.tensors.items()}, ftype, src.metadata)
    for name, s in src.tensors.items():
        o = out.tensors[name]
        want = plan[name] if plan[name] is not None else T(s.qtype)
        assert (T(o.qtype), o.shape) == (want, s.shape), name
        if want == s.qtype:
            expected = np.asarray(s.data).view(np.uint8).reshape(-1)
        else:
            expected = quantize(dequantize(s.data, s.qtype, s.shape), want).reshape(-1)
        assert np.array_equal(np.asarray(o.data).view(np.uint8).reshape(-1), expected), name
    # metadata: every key, value and value type carried over; file type / version updated
    changed = {"general.file_type", "general.quantization_version"}
    assert set(out.metadata) == set(src.metadata) | changed
    for key in set(src.metadata) - changed:
        assert (out.metadata[key], out.value_types[key]) == (src.metadata[key], src.value_types[key]), key
    assert out.metadata["general.file_type"] == int(FILE_TYPES[ftype].ftype)
    assert out.metadata["general.quantization_version"] == 2
    assert out.value_types["general.file_type"] == (gguf.GGUFValueType.UINT32, None)


def test_export_mix_on_the_tiny_model(exports):
    q4km = {n: T(t.qtype) for n, t in read_gguf(exports["Q4_K_M"]).tensors.items()}
    assert q4km["token_embd.weight"] == T.Q6_K  # tied: the output's type
    assert [q4km[f"blk.{i}.attn_v.weight"] for i in range(4)] == [T.Q4_K, T.Q4_K, T.Q6_K, T.Q6_K]
    assert [q4km[f"blk.{i}.ffn_down.weight"] for i in range(4)] == [T.Q5_0, T.Q5_0, T.Q8_0, T.Q8_0]
    assert q4km["blk.0.attn_norm.weight"] == T.F32


@pytest.mark.parametrize("ftype", EXPORT_TYPES)
def test_export_equals_llama_quantize(source, exports, ftype, tmp_path):
    """The same file as llama.cpp's ``llama-quantize`` writes, tensor for tensor, key for key."""
    llama_cpp = pytest.importorskip("llama_cpp")
    theirs = tmp_path / "llama.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 1
    params.ftype = int(FILE_TYPES[ftype].ftype)
    params.allow_requantize = True
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    ours, ref = read_gguf(exports[ftype]), read_gguf(theirs)
    assert set(ours.tensors) == set(ref.tensors)
    for name, r in ref.tensors.items():
        o = ours.tensors[name]
        assert (o.type_name, o.shape) == (r.type_name, r.shape), name
        assert np.array_equal(np.asarray(o.data).view(np.uint8), np.asarray(r.data).view(np.uint8)), name
    assert ours.metadata == ref.metadata and ours.value_types == ref.value_types


def test_export_loads_and_generates_in_turbollm(exports):
    from turbollm import LLM, SamplingParams

    llm = LLM(str(exports["Q4_K_M"]), kv_cache_memory=1 << 20)
    out = llm.generate(["a b"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.model
def test_smollm2_export_runs_in_turbollm_and_llama_cpp(tmp_path):
    from conftest import catalog_model_path

    from turbollm import LLM, SamplingParams

    out = export_gguf(catalog_model_path("smollm2-135m"), tmp_path / "smollm2-Q4_0.gguf", "Q4_0", progress=False)
    meta = read_gguf(out).metadata
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and meta["tokenizer.ggml.merges"][0] == "Ġ t"
    prompt = "1, 2, 3, 4, 5,"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text = LLM(str(out), kv_cache_memory=8 << 20).generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    assert text.startswith(" 6, 7"), text
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, n_batch=16, n_threads=1, verbose=False)
    done = llm.create_completion(prompt, max_tokens=6, temperature=0.0)
    assert done["choices"][0]["text"] == text  # same greedy continuation in llama.cpp


def test_export_bad_input_fails_before_work(source, tmp_path, monkeypatch):
    with pytest.raises(GGUFExportError, match="unknown GGUF type 'Q4_K_X'.*Q4_K_M"):
        export_gguf("no-such-model", tmp_path / "a.gguf", "Q4_K_X")
    existing = tmp_path / "exists.gguf"
    existing.write_bytes(b"keep")
    with pytest.raises(GGUFExportError, match="already exists"):
        export_gguf(source, existing, "Q8_0")
    assert existing.read_bytes() == b"keep"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedExportSourceError, match="safetensors"):
        export_gguf(hf, tmp_path / "b.gguf", "Q8_0")

    calls = []

    def interrupted(t, qtype):
        calls.append(t.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return quantize(dequantize(t.data, t.qtype, t.shape), qtype)

    monkeypatch.setattr(gguf_export, "_encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(source, tmp_path / "c.gguf", "Q4_K_M", progress=False)
    assert len(calls) == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["exists.gguf", "hf"]
