"""Runtime quantization methods (int8, int4/int3 at load; GPTQ/AWQ checkpoint layouts) and bad input.

- packing: our nibbles and 3-bit blocks, the int32 bit streams of GPTQ (3-bit codes straddling
  words as in AutoGPTQ's scheme) and AWQ's interleaved order round-trip and match hand-written
  references;
- "int8" / "int4-g32" / "int3-g64" at load: every linear holds only the quantized layout (no
  float32 matrix; 3-bit codes in 3 bits), multiplies like an fp32 matmul by its dequantized
  weight, and the model's resident bytes are exactly the format's; act-order storage permutes
  the input (4-bit and 3-bit);
- quantized checkpoints that are broken (missing or dense tensors, inconsistent g_idx, bad
  quantization_config) and bad `turbollm quantize` options fail with errors that name the
  problem, before any work.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from gguf import GGMLQuantizationType, quants  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from quant_tiny import build_tiny, calibration_text, token_windows  # noqa: E402
from quant_tiny import one_thread_exact_matmul  # noqa: E402,F401 (autouse fixture)
from turbollm.errors import InvalidRequestError, ModelFormatError, WeightLoadError  # noqa: E402
from turbollm.eval.parity import score  # noqa: E402
from turbollm.formats.packing import (pack_3bit, pack_awq, pack_int32, pack_nibbles, unpack_3bit,  # noqa: E402
                                     unpack_awq, unpack_int32, unpack_nibbles)
from turbollm.kernels.quant import ggml_dequantize  # noqa: E402
from turbollm.layers.linear import LinearBase  # noqa: E402
from turbollm.loader import load_model  # noqa: E402
from turbollm.quantization.footprint import format_bytes  # noqa: E402
from turbollm.quantization.equalize import equalize_decoder  # noqa: E402
from turbollm.quantization.group_quant import QuantGrid, QuantizedWeight, int8_per_channel, rtn_quantize  # noqa: E402
from turbollm.quantization.int4_method import Int4LinearMethod, layer_codes, set_int4_weight  # noqa: E402
from turbollm.quantize.methods import QuantizeOptions  # noqa: E402
from turbollm.quantize.runner import run_quantize  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def int4_folder(tiny_llama, tmp_path_factory) -> Path:
    """The tiny llama quantized by RTN int4 g32, written as a GPTQ folder."""
    out = tmp_path_factory.mktemp("q") / "int4"
    run_quantize(QuantizeOptions(str(tiny_llama), "int4", out, group_size=32, progress=False), log=lambda s: None)
    return out


# ------------------------------------------------------------------------------ packing


def _autogptq_style_pack3(v: torch.Tensor) -> torch.Tensor:
    """3-bit codes [K, N] → words [3K/32, N]: 10 codes per word, codes 10 and 21 split over two words."""
    out = torch.zeros(v.shape[0] * 3 // 32, v.shape[1], dtype=torch.int64)
    i = row = 0
    while row < out.shape[0]:
        for j in range(10):
            out[row] |= v[i + j] << (3 * j)
        i += 10
        out[row] |= (v[i] << 30) & 0xFFFFFFFF
        row += 1
        out[row] |= (v[i] >> 2) & 1
        i += 1
        for j in range(10):
            out[row] |= v[i + j] << (3 * j + 1)
        i += 10
        out[row] |= (v[i] << 31) & 0xFFFFFFFF
        row += 1
        out[row] |= (v[i] >> 1) & 3
        i += 1
        for j in range(10):
            out[row] |= v[i + j] << (3 * j + 2)
        i += 10
        row += 1
    return out


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_int32_bitstream_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    v = torch.randint(0, 1 << bits, (64, 24), generator=g)
    words = pack_int32(v, bits, dim=0)
    assert words.dtype == torch.int32 and words.shape == (64 * bits // 32, 24)
    assert torch.equal(unpack_int32(words, bits, dim=0), v)
    assert torch.equal(unpack_int32(pack_int32(v.t(), bits, dim=1), bits, dim=1), v.t())
    if bits == 3:
        assert torch.equal(words.to(torch.int64) & 0xFFFFFFFF, _autogptq_style_pack3(v))
    if bits == 4:  # value i of a word at shift 4i
        expected = sum(v[i::8].to(torch.int64) << (4 * i) for i in range(8))
        assert torch.equal(words.to(torch.int64) & 0xFFFFFFFF, expected)


def test_awq_order_and_nibbles():
    v = torch.arange(16).repeat(3, 1) % 16  # [3, 16]: columns 0..15
    words = pack_awq(v)
    nib = [(int(words[0, 0]) >> (4 * i)) & 0xF for i in range(8)]
    assert nib == [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i holds column AWQ_ORDER[i]
    assert torch.equal(unpack_awq(words), v)
    q = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert torch.equal(packed[:, 0] & 0xF, q[:, 0]) and torch.equal(packed[:, 0] >> 4, q[:, 1])
    assert torch.equal(unpack_nibbles(packed), q)


def test_3bit_packing():
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 8, (5, 96), dtype=torch.uint8, generator=g)
    packed = pack_3bit(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 96 // 32 * 12)
    assert torch.equal(unpack_3bit(packed), q)
    # the documented layout, block by block: byte j holds the low 2 bits of codes j, j+8, j+16,
    # j+24 at shifts 0, 2, 4, 6; bytes 8..11 a little-endian uint32 whose bit i is bit 2 of code i
    for r in range(5):
        for b in range(3):
            blk, c = packed[r, 12 * b:12 * b + 12].tolist(), q[r, 32 * b:32 * b + 32].tolist()
            assert blk[:8] == [sum((c[j + 8 * s] & 3) << (2 * s) for s in range(4)) for j in range(8)]
            assert int.from_bytes(bytes(blk[8:]), "little") == sum(((v >> 2) & 1) << i for i, v in enumerate(c))
    assert torch.equal(unpack_3bit(pack_3bit(q.view(5, 3, 32))), q.view(5, 3, 32))  # leading dims
    with pytest.raises(ValueError, match="not a multiple of 32"):
        pack_3bit(q[:, :48])


def test_grid_keeps_one_sided_groups_and_fp16_scales():
    w = torch.tensor([[0.0, 0.1, 0.5, 1.5], [-2.0, -1.0, -0.5, -0.25]])
    for zero_min in (0, 1):
        grid = QuantGrid(4, zero_min=zero_min)
        scale, zero = grid.params(w)
        assert torch.equal(scale, scale.half().float())
        assert bool((zero >= zero_min).all())
        deq = grid.fake_quantize(w, scale[:, None], zero[:, None])
        assert float((deq - w).abs().max()) <= float(scale.max()) / 2 + 1e-6  # nothing clipped


# ------------------------------------------------------------------------ methods at load


def _dequantized(layer: LinearBase) -> torch.Tensor:
    if layer.weight.dtype == torch.int8:
        return layer.weight.float() * layer.weight_scale[:, None]
    g = layer.int4_group_size
    q = layer_codes(layer).float().view(layer.out_features, -1, g)
    w = (q - layer.weight_zeros.float()[..., None]) * layer.weight_scales.float()[..., None]
    return w.reshape(layer.out_features, -1)


Q8_0 = int(GGMLQuantizationType.Q8_0)


def _linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase)]


@pytest.mark.parametrize("method,bits,group", [("int8", 8, None), ("int8-rtn", 8, None), ("int4-g32", 4, 32),
                                               ("int3-g64", 3, 64)])
def test_method_at_load_matches_dequantized_reference(tiny_llama, method, bits, group):
    fp = load_model(str(tiny_llama))
    if method == "int8":  # int8 rounds the equalized weights (tests/test_int8_equalize.py); int8-rtn as loaded
        equalize_decoder(fp.model)
    q = load_model(str(tiny_llama), quantization=method)
    expected_bytes = fp.weight_bytes
    for (name, ql), (_, fl) in zip(_linears(q.model), _linears(fp.model)):
        w = fl.weight.data
        n, k = w.shape
        floats = [p for pn, p in ql.named_parameters(recurse=False) if p.is_floating_point() and p.dim() == 2
                  and p.shape == (n, k)]
        assert not floats, f"{name}: a float32 [N, K] matrix is still resident"
        if bits == 8:
            ref_q, ref_s = int8_per_channel(w)
            assert torch.equal(ql.weight, ref_q) and torch.equal(ql.weight_scale, ref_s)
            expected_bytes += n * k + 4 * n - 4 * n * k
        else:
            ref = rtn_quantize(w, QuantGrid(bits), group)
            unpack = unpack_3bit if bits == 3 else unpack_nibbles
            assert ql.weight.shape == (n, k * bits // 8)  # 3-bit codes in 3 bits, 4-bit in nibbles
            assert torch.equal(unpack(ql.weight), ref.q) and int(ref.q.max()) < (1 << bits)
            assert torch.equal(_dequantized(ql), ref.dequantize())
            expected_bytes += n * k * bits // 8 + (2 + 1) * n * (k // group) - 4 * n * k  # fp16 scale, uint8 zero
        x = torch.randn(7, k)
        ref_y = F.linear(x, _dequantized(ql), ql.bias)
        assert torch.allclose(ql(x), ref_y, rtol=1e-4, atol=1e-5)
    # the dense vocabulary table (tied LM head) is held as Q8_0 blocks, those of gguf-py's encoder
    table, emb = fp.model.model.embed_tokens.weight.data, q.model.model.embed_tokens
    assert emb.qtype == Q8_0 and q.model.lm_head.weight is emb.weight
    assert torch.equal(emb.weight, torch.from_numpy(quants.quantize(table.numpy(), Q8_0)).view(torch.uint8))
    v, d = table.shape
    expected_bytes += v * d // 32 * 34 - 4 * v * d
    assert q.weight_bytes == expected_bytes
    # the whole model equals the float model carrying the dequantized weights
    with torch.no_grad():
        table.copy_(ggml_dequantize(emb.weight, Q8_0, d))
        for (_, ql), (_, fl) in zip(_linears(q.model), _linears(fp.model)):
            fl.weight.data.copy_(_dequantized(ql))
    ids = token_windows(1, 40)[0].tolist()
    assert torch.allclose(score(q, [ids])[0], score(fp, [ids])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method,bits,group", [("int4-g32", 4, 32), ("int3-g64", 3, 64)])
def test_format_bytes_counts_the_format_not_the_container(tiny_llama, method, bits, group):
    fp, q = load_model(str(tiny_llama)), load_model(str(tiny_llama), quantization=method)
    assert format_bytes(fp.model) == fp.weight_bytes  # float32: the storage is the format
    expected = q.weight_bytes
    for _, layer in _linears(q.model):
        n, k = layer.out_features, layer.in_features
        held = layer.weight.numel() + 3 * layer.weight_scales.numel()  # codes, fp16 scale, uint8 zero
        assert held == n * k * bits // 8 + 3 * n * (k // group)  # 3-bit codes in 3 bits
        assert held == layer.method.weight_bytes(layer)
        expected += n * k * (bits + (16 + bits) / group) / 8 - held
        # resident / format of the layer: (b + 24/g) / (b + (16 + b)/g), within 10%
        assert held / (layer.method.format_bits(layer) * n * k / 8) == pytest.approx(
            (bits + 24 / group) / (bits + (16 + bits) / group))
        assert held / (layer.method.format_bits(layer) * n * k / 8) < 1.1
    assert format_bytes(q.model) == pytest.approx(expected)


@pytest.mark.parametrize("bits", [4, 3])
def test_act_order_storage_permutes_the_input(bits):
    g = torch.Generator().manual_seed(0)
    n, k, group = 24, 64, 32
    w = torch.randn(n, k, generator=g)
    perm = torch.randperm(k, generator=g)
    stored = rtn_quantize(w[:, perm], QuantGrid(bits), group)
    qw = QuantizedWeight(stored.q, stored.scales, stored.zeros, bits, group, perm)
    layer = torch.nn.Module()
    layer.in_features, layer.out_features = k, n
    method = Int4LinearMethod(bits, group, prequantized=True, act_order=True)
    layer.weight_loader = None
    method.create_weights(layer, k, n, torch.float32)
    assert layer.weight.shape == (n, k * bits // 8)
    set_int4_weight(layer, qw)
    assert layer.weight.shape == (n, k * bits // 8) and torch.equal(layer_codes(layer), stored.q)
    x = torch.randn(5, k, generator=g)
    assert torch.allclose(method.apply(layer, x, None), F.linear(x, qw.dequantize()), rtol=1e-5, atol=1e-5)
    assert torch.equal(qw.group_index()[perm], torch.arange(k, dtype=torch.int32) // group)


def test_int3_needs_whole_blocks_of_32_columns():
    layer = torch.nn.Module()
    layer.weight_loader = None
    with pytest.raises(InvalidRequestError, match="48 input features are not a multiple of 32"):
        Int4LinearMethod(3, 16, prequantized=True).create_weights(layer, 48, 8, torch.float32)
    Int4LinearMethod(4, 16, prequantized=True).create_weights(layer, 48, 8, torch.float32)  # nibbles: fine


def test_bad_quantization_names(tiny_llama):
    with pytest.raises(InvalidRequestError, match="group size 128 does not divide .* 64 input features"):
        load_model(str(tiny_llama), quantization="int4-g128")
    with pytest.raises(InvalidRequestError, match="unknown quantization 'int5'"):
        load_model(str(tiny_llama), quantization="int5")
    with pytest.raises(InvalidRequestError, match="turbollm quantize MODEL --method gptq"):
        load_model(str(tiny_llama), quantization="gptq")


# ------------------------------------------------------------------- broken quantized folders


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(folder: Path, edit=None, config=None) -> None:
    if edit is not None:
        path = folder / "model.safetensors"
        tensors = load_file(str(path))
        edit(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg["quantization_config"])
        (folder / "config.json").write_text(json.dumps(cfg))


def test_quantized_folder_loads_as_gptq(int4_folder):
    loaded = load_model(str(int4_folder))
    assert loaded.quantization == "gptq"
    assert all(m.weight.dtype == torch.uint8 for _, m in _linears(loaded.model))
    with pytest.raises(InvalidRequestError, match="is a gptq checkpoint"):
        load_model(str(int4_folder), quantization="int8")


def test_missing_quantized_tensor(int4_folder, tmp_path):
    folder = _copy(int4_folder, tmp_path / "m")
    name = "model.layers.1.self_attn.k_proj.qzeros"
    _edit(folder, lambda t: t.pop(name))
    with pytest.raises(ModelFormatError, match=name.replace(".", r"\.")):
        load_model(str(folder))


def test_dense_linear_in_quantized_folder(int4_folder, tmp_path):
    folder = _copy(int4_folder, tmp_path / "m")
    name = "model.layers.0.mlp.up_proj.weight"
    _edit(folder, lambda t: t.__setitem__(name, torch.zeros(128, 64)))
    with pytest.raises(ModelFormatError, match="dense weight"):
        load_model(str(folder))


def test_g_idx_inconsistencies(int4_folder, tmp_path):
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))

    def permute(t):
        g_idx = torch.empty(64, dtype=torch.int32)
        g_idx[perm] = torch.arange(64, dtype=torch.int32) // 32
        t["model.layers.0.self_attn.q_proj.g_idx"] = g_idx

    folder = _copy(int4_folder, tmp_path / "a")
    _edit(folder, permute)
    with pytest.raises(ModelFormatError, match="desc_act is false"):
        load_model(str(folder))
    folder = _copy(int4_folder, tmp_path / "b")
    _edit(folder, permute, lambda q: q.__setitem__("desc_act", True))
    with pytest.raises(WeightLoadError, match="differs from the other shards"):
        load_model(str(folder))
    folder = _copy(int4_folder, tmp_path / "c")
    _edit(folder, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.g_idx", torch.zeros(64, dtype=torch.int32)))
    with pytest.raises(ModelFormatError, match="g_idx does not put exactly 32 columns"):
        load_model(str(folder))


@pytest.mark.parametrize("edit,match", [
    (lambda q: q.__setitem__("bits", 5), "bits = 5"),
    (lambda q: q.__setitem__("quant_method", "bitsandbytes"), "quant_method 'bitsandbytes'"),
    (lambda q: q.__setitem__("checkpoint_format", "marlin"), "checkpoint_format"),
    (lambda q: q.pop("bits"), "lacks 'bits'"),
])
def test_bad_quantization_config(int4_folder, tmp_path, edit, match):
    folder = _copy(int4_folder, tmp_path / "m")
    _edit(folder, config=edit)
    with pytest.raises(ModelFormatError, match=match):
        load_model(str(folder))


# ----------------------------------------------------------------------- quantize options


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="awq", bits=3), "awq supports --bits 4"),
    (dict(method="int4", bits=8), "int4 supports --bits 4 or 3"),
    (dict(method="int8", group_size=64), "per output channel"),
    (dict(method="gptq", group_size=100), "--group-size must be one of 32, 64, 128"),
    (dict(method="awq", act_order=True), "--act-order applies to --method gptq only"),
    (dict(method="gptq", awq_clip=False), "--awq-no-clip applies to --method awq only"),
    (dict(method="int4", awq_clip=True), "--awq-clip applies to --method awq only"),
    (dict(method="gptq", bits=8, act_order=True), "per channel"),
    (dict(method="int4", calib_samples=64), "uses no calibration data"),
    (dict(method="gptq", equalize=False), "--no-equalize applies to --method int8 only"),
    (dict(method="gguf", gguf_type="Q8_0", equalize=False), "--method gguf takes --type, not --no-equalize"),
    (dict(method="gguf"), "--method gguf needs --type"),
    (dict(method="gguf", gguf_type="Q4_K_M", bits=4), "--method gguf takes --type, not --bits"),
    (dict(method="gguf", gguf_type="Q4_K_M", awq_clip=False), "--method gguf takes --type, not --awq-no-clip"),
    (dict(method="gptq", gguf_type="Q4_0"), "--type applies to --method gguf only"),
    (dict(method="int4", logit_scale=True), "--fit-logit-scale applies to --method gptq or awq only"),
    (dict(method="int8", logit_scale=False), "--no-fit-logit-scale applies to --method gptq or awq only"),
    (dict(method="gguf", gguf_type="Q8_0", logit_scale=True), "--method gguf takes --type, not --fit-logit-scale"),
    (dict(method="int2"), "--method 'int2' is not one of"),
    (dict(method="gptq", group_size=128), "--group-size 128 does not divide the input width 64"),
    (dict(method="gptq", group_size=32, calib_samples=1000, calib_seq_len=64), "calibration set too small"),
    (dict(method="awq", group_size=32, calib_seq_len=512), "exceeds the model's context of 256"),
])
def test_bad_quantize_options(tiny_llama, tmp_path, kwargs, match):
    calib = calibration_text(tmp_path / "calib.txt", words=2000)
    opts = QuantizeOptions(str(tiny_llama), kwargs.pop("method"), tmp_path / "out", progress=False, **kwargs)
    if opts.method in ("gptq", "awq"):
        opts.calib_data = str(calib)
    with pytest.raises(InvalidRequestError, match=match):
        run_quantize(opts, log=lambda s: None)
    assert not (tmp_path / "out").exists()


def test_existing_output_and_evaluation_text(tiny_llama, tmp_path, capsys):
    from turbollm.cli.main import main

    (tmp_path / "out").mkdir()
    assert main(["quantize", str(tiny_llama), "--method", "int4", "--group-size", "32", "--out",
                 str(tmp_path / "out")]) == 1
    assert "already exists" in capsys.readouterr().err
    wiki = tmp_path / "wiki.test.raw"
    wiki.write_text("w5 w6 " * 1000)
    opts = QuantizeOptions(str(tiny_llama), "gptq", tmp_path / "o2", group_size=32, calib_seq_len=64,
                           calib_data=str(wiki))
    with pytest.raises(InvalidRequestError, match="evaluation text"):
        run_quantize(opts, log=lambda s: None)


def test_cli_lists_match_registries():
    from turbollm.cli import quantize_cmd
    from turbollm.quantize.methods import GGUF_TYPES, QUANTIZE_METHODS

    assert set(quantize_cmd.METHODS) == {*QUANTIZE_METHODS, "gguf"}
    assert quantize_cmd.GGUF_TYPES == GGUF_TYPES


@pytest.mark.parametrize("method,on,off,dest", [
    ("awq", "--awq-clip", "--awq-no-clip", "awq_clip"),
    ("gptq", "--fit-logit-scale", "--no-fit-logit-scale", "logit_scale"),
])
def test_on_off_flag_pairs(method, on, off, dest):
    """Each on/off pair: not given → None (the method's default), either flag says its value, not both."""
    from turbollm.cli.main import build_parser

    parse = build_parser().parse_args
    base = ["quantize", "m", "--method", method, "--out", "o"]
    assert getattr(parse(base), dest) is None and getattr(parse(base + [on]), dest) is True
    assert getattr(parse(base + [off]), dest) is False
    with pytest.raises(SystemExit):
        parse(base + [on, off])


def test_on_off_defaults():
    """Clipping is off unless asked for; the logit-scale fit is AWQ's default and GPTQ's option."""
    assert not QuantizeOptions("m", "awq", "o").clip and QuantizeOptions("m", "awq", "o", awq_clip=True).clip
    assert QuantizeOptions("m", "awq", "o").fit_logit_scale and not QuantizeOptions("m", "gptq", "o").fit_logit_scale
    assert not QuantizeOptions("m", "awq", "o", logit_scale=False).fit_logit_scale
    assert QuantizeOptions("m", "gptq", "o", logit_scale=True).fit_logit_scale
