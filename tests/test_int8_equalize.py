"""The int8 method's calibration-free channel equalization (turbollm/quantization/equalize.py).

- the synthetic-input statistic (RMS of every branch linear's input channels on random token
  ids) covers every linear, is positive, repeatable, and changes with the seed;
- the column-scale search lowers the *actual* per-row round-to-nearest error of a matrix with a
  few large columns (not only its own estimate), and returns the identity when nothing helps;
- equalizing a whole decoder leaves the float32 function unchanged (llama with GQA, qwen2 with
  Q/K/V biases, gemma3 with (1+w) norms and post-branch norms);
- on a tiny model rewritten, without changing its function, so that a few input columns of
  every linear hold large weights, ``int8`` (equalized) is closer to the float model than
  ``int8-rtn``, and ``int8-rtn`` is plain per-row rounding of the weights as loaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from quant_tiny import build_tiny, token_windows  # noqa: E402
from quant_tiny import one_thread_exact_matmul  # noqa: E402,F401 (autouse fixture)
from turbollm.eval.parity import score  # noqa: E402
from turbollm.kernels import get_kernels  # noqa: E402
from turbollm.layers.linear import LinearBase  # noqa: E402
from turbollm.loader import load_model  # noqa: E402
from turbollm.models.branches import get_adapter  # noqa: E402
from turbollm.quantization.equalize import (equalize_decoder, rtn_error, rtn_errors,  # noqa: E402
                                            scaled_row_max_reference, search_column_scales,
                                            synthetic_input_rms)
from turbollm.quantization.group_quant import int8_per_channel  # noqa: E402

WINDOWS = token_windows(3, 40)


def _logits(loaded) -> torch.Tensor:
    return torch.cat(score(loaded, [w.tolist() for w in WINDOWS]))


def _rtn_mse(w: torch.Tensor, c: torch.Tensor) -> float:
    """Mean squared error, in the original units, of rounding ``w · diag(c)`` per row to int8."""
    q, s = int8_per_channel(w * c)
    return float(((q.float() * s[:, None]) / c - w).square().mean())


def test_search_lowers_the_actual_rounding_error_of_large_columns():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g)
    w[:, [5, 77, 200]] *= 40.0
    c, ratio = search_column_scales(w)
    one = torch.ones(256)
    assert ratio < 0.5
    assert rtn_error(w, c, one) == pytest.approx(ratio * rtn_error(w, one, one), rel=1e-5)
    assert float(c[[5, 77, 200]].max()) < float(c.median())
    assert _rtn_mse(w, c) < 0.5 * _rtn_mse(w, one)


@pytest.mark.parametrize("rows,cols", [(37, 24), (8, 896), (5, 3)])
def test_batched_search_errors_equal_the_plain_form(rows, cols):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(rows, cols, generator=g)
    cands = torch.rand(6, cols, generator=g) + 0.1
    a = torch.rand(cols, generator=g) + 0.5
    reference = scaled_row_max_reference(w.abs(), cands)
    kernels = get_kernels()
    if kernels is not None:  # the kernel's maxima are the reference's, bit for bit
        assert torch.equal(kernels.scaled_row_max(w.abs().contiguous(), cands), reference)
    errs = rtn_errors(w.abs(), cands, a)
    for k in range(6):
        assert float(errs[k]) == pytest.approx(rtn_error(w, cands[k], a), rel=1e-5)
        assert torch.equal(reference[k], (w.abs() * cands[k]).amax(1))


def test_search_keeps_identity_when_nothing_helps_and_shares_scales_across_a_gqa_group():
    w = torch.ones(16, 32)
    w[::2] = -1.0  # every column the same size: no column scale lowers any row's step
    c, ratio = search_column_scales(w)
    assert ratio == 1.0 and torch.equal(c, torch.ones(32))
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 4 * 8, generator=g)  # 4 query heads of 8, 2 per KV head
    w[:, 3] *= 50.0
    c, ratio = search_column_scales(w, group=2, head_dim=8)
    assert c.shape == (16,) and ratio < 1.0


@torch.no_grad()
def test_synthetic_input_statistics(tmp_path):
    loaded = load_model(str(build_tiny("qwen2", tmp_path / "qwen2")))
    branches = [br for layer in loaded.model.model.layers for br in get_adapter("qwen2").branches(layer)]
    rms = synthetic_input_rms(loaded.model, branches, tokens=32)
    assert set(rms) == {id(lin) for br in branches for lin in (br.first, br.second)}
    for br in branches:
        assert rms[id(br.first)].shape == (br.first.in_features,)
        assert rms[id(br.second)].shape == (br.second.in_features,)
        assert bool((rms[id(br.first)] > 0).all())
    again = synthetic_input_rms(loaded.model, branches, tokens=32)
    assert all(torch.equal(rms[k], again[k]) for k in rms)
    other = synthetic_input_rms(loaded.model, branches, tokens=32, seed=1)
    assert not torch.equal(rms[id(branches[0].first)], other[id(branches[0].first)])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@torch.no_grad()
def test_equalization_is_exact_in_float(tmp_path, arch):
    folder = build_tiny(arch, tmp_path / arch)
    loaded = load_model(str(folder))
    before = _logits(loaded)
    norm_before = loaded.model.model.layers[0].input_layernorm.weight.clone()
    report = equalize_decoder(loaded.model)
    assert report.folds == 2 * 2 * len(loaded.model.model.layers)
    assert not torch.equal(loaded.model.model.layers[0].input_layernorm.weight, norm_before)
    after = _logits(loaded)
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4), float((after - before).abs().max())


def _with_large_columns(src: Path, dst: Path) -> Path:
    """A copy of the tiny llama checkpoint with the same function but large weights in a few
    input columns of every linear (norm weights and feeder rows divided to compensate)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    t = load_file(str(path))
    cols, big = [1, 9, 30], 25.0
    for name in list(t):
        if not name.endswith("input_layernorm.weight") and not name.endswith("post_attention_layernorm.weight"):
            continue
        prefix = name.rsplit(".", 2)[0]
        t[name] = t[name].clone()
        t[name][cols] /= big
        linears = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") if "input" in name \
            else ("mlp.gate_proj", "mlp.up_proj")
        for lin in linears:
            w = t[f"{prefix}.{lin}.weight"].clone()
            w[:, cols] *= big
            t[f"{prefix}.{lin}.weight"] = w
        if "post_attention" in name:  # down_proj's input columns, fed by up_proj's rows
            up, down = t[f"{prefix}.mlp.up_proj.weight"].clone(), t[f"{prefix}.mlp.down_proj.weight"].clone()
            up[cols] /= big
            down[:, cols] *= big
            t[f"{prefix}.mlp.up_proj.weight"], t[f"{prefix}.mlp.down_proj.weight"] = up, down
    save_file(t, str(path), metadata={"format": "pt"})
    return dst


@torch.no_grad()
def test_equalized_int8_is_closer_to_float_than_plain_rtn(tmp_path):
    folder = _with_large_columns(build_tiny("llama", tmp_path / "llama"), tmp_path / "llama-large-cols")
    ref = _logits(load_model(str(build_tiny("llama", tmp_path / "plain"))))
    fp = load_model(str(folder))
    assert torch.allclose(_logits(fp), ref, rtol=1e-4, atol=1e-4)  # the rewrite kept the function
    dense = {n: m.weight.detach().clone() for n, m in fp.model.named_modules() if isinstance(m, LinearBase)}

    rtn = load_model(str(folder), quantization="int8-rtn")
    for n, m in rtn.model.named_modules():  # int8-rtn: each row of the loaded weight, rounded
        if isinstance(m, LinearBase):
            q, s = int8_per_channel(dense[n])
            assert torch.equal(m.weight, q) and torch.equal(m.weight_scale, s)
    eq = load_model(str(folder), quantization="int8")
    err_rtn = float((_logits(rtn) - ref).square().mean())
    err_eq = float((_logits(eq) - ref).square().mean())
    assert err_eq < 0.5 * err_rtn, (err_eq, err_rtn)


@torch.no_grad()
def test_offline_int8_equalizes_unless_told_not_to(tmp_path):
    import json

    from turbollm.quantize.methods import QuantizeOptions
    from turbollm.quantize.runner import run_quantize

    folder = _with_large_columns(build_tiny("llama", tmp_path / "llama"), tmp_path / "llama-large-cols")
    ref = _logits(load_model(str(folder)))
    errs = {}
    for equalize in (None, False):
        out = tmp_path / f"int8-{equalize}"
        run_quantize(QuantizeOptions(str(folder), "int8", out, equalize=equalize, progress=False), log=lambda s: None)
        assert json.loads((out / "config.json").read_text())["quantization_config"]["equalize"] is (equalize is None)
        errs[equalize] = float((_logits(load_model(str(out))) - ref).square().mean())
    assert errs[None] < 0.5 * errs[False], errs
