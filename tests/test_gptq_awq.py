"""Offline quantizers (GPTQ, AWQ), their export to GPTQ/AWQ safetensors folders, and loading back.

On tiny generated models (llama with GQA, qwen2 with Q/K/V biases and an untied head, gemma3
with x·(1+w) norms, post-branch norms and MQA):
- the branch-by-branch calibration runner computes exactly the model's own forward pass;
- GPTQ's result has a lower output reconstruction error than round-to-nearest on the same
  calibration inputs, for every linear (4-bit, 3-bit, act-order);
- folding AWQ scales leaves the float32 function unchanged (to float32 rounding), and AWQ's
  quantized model is closer to the float one than RTN's on the calibration tokens;
- export → load is exact: every loaded linear dequantizes to the very weights the quantizer
  produced (3-bit GPTQ codes resident in 3 bits), and the loaded model's logits equal the
  in-memory quantized model's;
- a GGUF source's tokenizer and config survive the trip to tokenizer.json / config.json;
- an interrupted export leaves no folder behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from gguf import GGMLQuantizationType, quants  # noqa: E402
from quant_tiny import calibration_text, token_windows  # noqa: E402
from quant_tiny import one_thread_exact_matmul, tiny  # noqa: E402,F401 (fixtures)
from turbollm.eval.parity import score  # noqa: E402
from turbollm.kernels.quant import ggml_dequantize  # noqa: E402
from turbollm.layers.linear import LinearBase  # noqa: E402
from turbollm.loader import load_model  # noqa: E402
from turbollm.models.branches import get_adapter  # noqa: E402
from turbollm.quantization.checkpoint_layouts import get_layout  # noqa: E402
from turbollm.quantization.group_quant import QuantGrid, rtn_quantize  # noqa: E402
from turbollm.quantization.int4_method import layer_codes  # noqa: E402
from turbollm.quantization.scale_folding import fold_scales  # noqa: E402
from turbollm.quantize.awq import AWQAlgorithm, branch_error, candidate_scales  # noqa: E402
from turbollm.quantize.calibration_runner import CalibrationRunner  # noqa: E402
from turbollm.quantize.export_safetensors import write_quantized_folder  # noqa: E402
from turbollm.quantize.gptq import GPTQAlgorithm  # noqa: E402
from turbollm.quantize.methods import QUANTIZE_METHODS, QuantizeOptions  # noqa: E402
from turbollm.quantize.pipeline import quantize_decoder  # noqa: E402
from turbollm.quantize.rtn import rtn_decoder  # noqa: E402

WINDOWS = token_windows(8, 48)
Q8_0 = int(GGMLQuantizationType.Q8_0)


def _linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase)]


def _logits(loaded, windows=WINDOWS[:3]):
    return torch.cat(score(loaded, [w.tolist() for w in windows]))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@torch.no_grad()
def test_branch_runner_equals_model_forward(tiny, arch):
    loaded = load_model(str(tiny(arch)))
    model = loaded.model
    runner = CalibrationRunner(model, WINDOWS[:4], tokens_per_batch=96)
    adapter = get_adapter(arch)
    x = runner.embed(adapter)
    for layer in model.model.layers:
        for br in adapter.branches(layer):
            for rows, batch in runner.batches:
                x[rows] = br.residual(x[rows], br.inner(br.norm(x[rows]), batch))
    for rows, batch in runner.batches:
        ours = model.compute_logits(model.model.norm(x[rows]))
        ref = model.compute_logits(model(batch))
        assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-5)


class RecordingGPTQ(GPTQAlgorithm):
    """GPTQ that keeps each linear's original weight and calibration inputs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inputs: dict[int, list] = {}
        self.originals: dict[str, tuple] = {}

    def _observe(self, linear, x):
        self.inputs.setdefault(id(linear), []).append(x.clone())
        super()._observe(linear, x)

    def _quantize(self, linear):
        self.originals[self.name(linear)] = (linear.weight.data.clone(), torch.cat(self.inputs.pop(id(linear))))
        super()._quantize(linear)


@pytest.mark.parametrize("arch,bits,act_order", [("llama", 4, False), ("qwen2", 3, False), ("gemma3", 4, True)])
def test_gptq_beats_rtn_on_every_layer(tiny, arch, bits, act_order):
    loaded = load_model(str(tiny(arch)))
    grid = QuantGrid(bits, zero_min=1)
    alg = RecordingGPTQ(grid, 32, act_order=act_order)
    quantize_decoder(loaded.model, WINDOWS, alg, progress=False)
    assert len(alg.originals) == len(_linears(loaded.model))
    for name, (w, x) in alg.originals.items():
        def err(wq):
            return float((x @ (wq - w).t()).pow(2).sum())
        gptq, rtn = err(alg.results[name].dequantize()), err(rtn_quantize(w, grid, 32).dequantize())
        assert gptq < 0.9 * rtn, f"{name}: GPTQ error {gptq:.4g} not below RTN {rtn:.4g}"
        if act_order:
            assert alg.results[name].perm is not None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@torch.no_grad()
def test_awq_folding_is_exact_in_float(tiny, arch):
    loaded = load_model(str(tiny(arch)))
    before = _logits(loaded)
    g = torch.Generator().manual_seed(3)
    for layer in loaded.model.model.layers:
        for br in get_adapter(arch).branches(layer):
            s1 = torch.rand(br.first.in_features, generator=g) * 3 + 0.25
            s2 = torch.rand(br.feeder.stop - br.feeder.start, generator=g) * 3 + 0.25
            fold_scales(br, s1, s2)
    after = _logits(loaded)
    assert not torch.equal(loaded.model.model.layers[0].input_layernorm.weight,
                           load_model(str(tiny(arch))).model.model.layers[0].input_layernorm.weight)
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4), float((after - before).abs().max())


@pytest.mark.parametrize("arch,clip", [("llama", True), ("gemma3", True), ("llama", False)])
def test_awq_closer_than_rtn(tiny, arch, clip):
    fp = _logits(load_model(str(tiny(arch))), WINDOWS)
    awq_model = load_model(str(tiny(arch)))
    alg = AWQAlgorithm(QuantGrid(4), 32, search_tokens=128, clip=clip)
    quantize_decoder(awq_model.model, WINDOWS, alg, progress=False)
    rtn_model = load_model(str(tiny(arch)))
    rtn_decoder(rtn_model.model, QuantGrid(4), 32)
    awq_err = float((_logits(awq_model, WINDOWS) - fp).pow(2).mean())
    rtn_err = float((_logits(rtn_model, WINDOWS) - fp).pow(2).mean())
    assert awq_err < rtn_err, (awq_err, rtn_err, alg.alphas)
    assert any(a > 0 for pair in alg.alphas.values() for a in pair)  # salient channels got scaled


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
@torch.no_grad()
def test_awq_branch_error_is_the_branch_output_error(tiny, arch):
    """AWQ's objective for the norm-fed linears: the branch output with `first` replaced by
    Q(W·s)/s, against the float branch; `first` is restored afterwards."""
    model = load_model(str(tiny(arch))).model
    runner = CalibrationRunner(model, WINDOWS[:4], tokens_per_batch=96)
    assert len(runner.batches) == 2
    x = runner.embed(get_adapter(arch))
    layer = model.model.layers[0]
    g, grid = 32, QuantGrid(4)
    for br in get_adapter(arch).branches(layer):
        parts = [(br.norm(x[rows]), batch) for rows, batch in runner.batches]
        w = br.first.weight.data.clone()
        targets = [br.inner(h, batch) for h, batch in parts]
        s = candidate_scales(torch.cat([h for h, _ in parts]).abs().mean(0), None, 0.5)
        with branch_error(br, parts, grid, g) as error:
            got_one, got_s = error(torch.ones_like(s)), error(s)
        assert torch.equal(br.first.weight.data, w)
        for scale, got in ((torch.ones_like(s), got_one), (s, got_s)):
            br.first.weight.data.copy_(rtn_quantize(w * scale, grid, g).dequantize() / scale)
            want = sum(float((br.inner(h, batch) - t).pow(2).sum()) for (h, batch), t in zip(parts, targets))
            br.first.weight.data.copy_(w)
            assert got == pytest.approx(want, rel=1e-5) and want > 0
        assert got_one != got_s


def test_awq_candidate_scales():
    x_mean = torch.tensor([4.0, 1.0, 0.25, 1.0])
    w_mean = torch.tensor([0.5, 0.5, 0.25, 1.0])
    torch.testing.assert_close(candidate_scales(x_mean, None, 0.0), torch.ones(4))
    torch.testing.assert_close(candidate_scales(x_mean, None, 0.5), torch.tensor([2.0, 1.0, 0.5, 1.0]))
    s = candidate_scales(x_mean, w_mean, 0.0)  # 1 / w_mean, normalized by sqrt(max·min)
    raw = 1 / (w_mean + 1e-4)
    torch.testing.assert_close(s, raw / (raw.max() * raw.min()).sqrt())


def _loaded_dequantized(layer: LinearBase) -> torch.Tensor:
    if layer.weight.dtype == torch.int8:
        return layer.weight.float() * layer.weight_scale[:, None]
    g = layer.int4_group_size
    q = layer_codes(layer).float().view(layer.out_features, -1, g)
    w = (q - layer.weight_zeros.float()[..., None]) * layer.weight_scales.float()[..., None]
    w = w.reshape(layer.out_features, -1)
    perm = getattr(layer, "weight_perm", None)
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


@pytest.mark.parametrize("arch,method,bits,act_order", [
    ("llama", "gptq", 4, True), ("qwen2", "gptq", 3, False), ("gemma3", "awq", 4, False),
    ("qwen2", "awq", 4, False), ("llama", "int8", 8, False), ("gemma3", "gptq", 8, False),
])
def test_export_load_round_trip_is_exact(tiny, tmp_path, arch, method, bits, act_order):
    spec = QUANTIZE_METHODS[method]
    group = spec.group_size(bits, None if bits == 8 else 32)
    grid = spec.grid(bits)
    src = load_model(str(tiny(arch)))
    if method == "gptq":
        alg = GPTQAlgorithm(grid, group, act_order=act_order)
    elif method == "awq":
        alg = AWQAlgorithm(grid, group, search_tokens=96)
    if method == "int8":
        results = rtn_decoder(src.model, grid, group)
    else:
        quantize_decoder(src.model, WINDOWS, alg, progress=False)
        results = alg.results
    out = write_quantized_folder(src, results, get_layout(spec.layout), spec.layout_config(bits, group, act_order),
                                 tmp_path / "q")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == spec.layout and config["bits"] == bits
    back = load_model(str(out))
    assert back.quantization == spec.layout
    for (name, layer), (_, src_layer) in zip(_linears(back.model), _linears(src.model)):
        if bits < 8:  # 3-bit codes resident in 3 bits, 4-bit in nibbles
            assert layer.weight.shape == (layer.out_features, layer.in_features * bits // 8), name
        assert torch.equal(_loaded_dequantized(layer), results[name].dequantize()), name
        assert torch.equal(_loaded_dequantized(layer), src_layer.weight.data), name
        if src_layer.bias is not None:
            assert torch.equal(layer.bias, src_layer.bias)
    src_params = dict(src.model.named_parameters())
    for name, p in back.model.named_parameters():
        if "norm" in name:
            assert torch.allclose(p, src_params[name], rtol=0, atol=1e-6), name  # gemma: (1+w) - 1 + 1
    # the dense vocabulary tables come back as Q8_0 blocks (gguf-py's encoding of the exported table)
    with torch.no_grad():
        for table in {id(t): t for t in (back.model.model.embed_tokens, back.model.lm_head)}.values():
            src_table = src.model.get_submodule(_module_name(back.model, table)).weight
            assert table.qtype == Q8_0
            expected = quants.quantize(src_table.detach().numpy(), Q8_0)
            assert torch.equal(table.weight, torch.from_numpy(expected).view(torch.uint8))
            src_table.copy_(ggml_dequantize(table.weight, Q8_0, table.dim))
    diff = float((_logits(back) - _logits(src)).abs().max())
    assert diff < 1e-4, diff  # same weights; only the order of float32 sums differs (kernel, act-order)


def _module_name(model, module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def test_cli_end_to_end_and_atomic_writes(tiny, tmp_path, monkeypatch):
    from turbollm.cli.main import main

    folder = tiny("llama")
    calib = calibration_text(tmp_path / "c.txt", words=3000)
    stale = tmp_path / ".q.partial-999999999"
    stale.mkdir()
    args = ["quantize", str(folder), "--method", "gptq", "--group-size", "32", "--calib-samples", "8",
            "--calib-seq-len", "64", "--calib-data", str(calib), "--out", str(tmp_path / "q"), "--no-progress"]

    import safetensors.torch

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    assert main(args) == 130  # interrupted: nothing that looks like a model is left
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q.partial-*"))
    monkeypatch.undo()
    torch.set_num_threads(1)
    from turbollm.kernels import quant

    monkeypatch.setattr(quant, "DEFAULT_PATH", "dequant")
    stale.mkdir()
    assert main(args) == 0
    assert not stale.exists()  # a dead run's scratch folder is swept
    loaded = load_model(str(tmp_path / "q"))
    assert loaded.quantization == "gptq" and loaded.config == load_model(str(folder)).config


@pytest.mark.model
def test_gguf_source_tokenizer_and_config_round_trip(tmp_path):
    from conftest import catalog_model_path
    from turbollm.config import config_from_gguf, config_from_hf
    from turbollm.formats.gguf_file import read_gguf
    from turbollm.quantize.hf_folder import hf_config_dict, write_tokenizer
    from turbollm.tokenizer import Tokenizer

    path = catalog_model_path("smollm2-135m", download=False)
    gguf = read_gguf(path)
    tok = Tokenizer.from_gguf(gguf.metadata)
    cfg = config_from_gguf(gguf)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    write_tokenizer(tmp_path, tok, None)
    assert config_from_hf(tmp_path) == cfg
    back = Tokenizer.from_hf_folder(tmp_path)
    texts = ["Hello, world!  It's 3.14159 — ok?\n\tdone", "<|im_start|>user\nhi<|im_end|>", "naïve café 東京 🙂"]
    for text in texts:
        assert back.encode(text) == tok.encode(text)
        assert back.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert back.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert (back.bos_token_id, back.eos_token_id, back.add_bos_token) == (tok.bos_token_id, tok.eos_token_id,
                                                                          tok.add_bos_token)
    assert back.eos_token_ids == tok.eos_token_ids


def test_hessian_accumulator_triangle_path():
    from turbollm.quantize.gptq import TRIANGLE_MIN_K, HessianAccumulator

    k = TRIANGLE_MIN_K + 77  # blocked upper triangle, ragged last block
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(40, k, generator=g) for _ in range(3)]
    acc = HessianAccumulator(k)
    for x in xs:
        acc.add(x)
    x = torch.cat(xs)
    assert torch.allclose(acc.hessian(), 2 * x.t() @ x / x.shape[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("group, bits, sym", [(-1, 8, True), (256, 4, False), (64, 3, False)])
def test_gptq_lazy_batches_equal_one_batch(monkeypatch, group, bits, sym):
    """Lazy batches of 128 columns (groups wider than a batch: per channel, multiples of 128)
    give GPTQ's column-by-column result, computed here as one batch of the whole row."""
    import turbollm.quantize.gptq as gptq

    gen = torch.Generator().manual_seed(7)
    n, k = 24, 512
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(2000, k, generator=gen) * torch.rand(k, generator=gen) * 3
    h = 2 * x.t() @ x / x.shape[0]
    grid = QuantGrid(bits, symmetric=sym)
    batched = gptq.gptq_quantize(w, h, grid, group)
    monkeypatch.setattr(gptq, "BLOCK", k)
    whole = gptq.gptq_quantize(w, h, grid, group)
    assert torch.equal(batched.scales, whole.scales) and torch.equal(batched.zeros, whole.zeros)
    assert (batched.q != whole.q).float().mean() < 0.002  # float rounding may flip a rare tie
    err = [float((x @ (r.dequantize() - w).t()).pow(2).mean()) for r in (batched, whole)]
    assert err[0] == pytest.approx(err[1], rel=1e-3)


def test_options_defaults():
    opts = QuantizeOptions("m", "gptq", Path("x"))
    assert (opts.samples, opts.seq_len) == (128, 512)
