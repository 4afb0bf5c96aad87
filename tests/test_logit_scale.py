"""The logit-scale fit after offline quantization (turbollm/quantize/logit_scale.py).

Tiny generated models (quant_tiny.py): a known temperature put on a copy must be found again,
a model equal to its reference must be left at β = 1, the fold must scale the logits exactly,
and the soft-cap path of the fit must agree with the model's own `compute_logits`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from quant_tiny import token_windows  # noqa: E402
from quant_tiny import one_thread_exact_matmul, tiny  # noqa: E402,F401 (fixtures)

from turbollm.loader import load_model  # noqa: E402
from turbollm.quantize.logit_scale import (apply_logit_scale, final_hidden, fit_logit_scale,  # noqa: E402
                                           fit_windows, kl_curve, refine)


def _pair(folder: Path):
    return load_model(str(folder), quantization="none").model, load_model(str(folder), quantization="none").model


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_known_temperature_is_recovered(tiny, arch):
    ref, cand = _pair(tiny(arch))
    windows = token_windows(4, 32)
    ref_hidden = final_hidden(ref, windows)
    apply_logit_scale(cand, 1 / 1.1)  # the candidate is 10% flatter than the reference
    fit = fit_logit_scale(cand, ref_hidden, windows)
    assert fit.beta == pytest.approx(1.1, abs=2e-3)
    assert fit.kl_before > 1e-3 and fit.kl_after < fit.kl_before / 100
    assert fit.entropy_before > fit.entropy_ref
    assert fit.entropy_after == pytest.approx(fit.entropy_ref, abs=1e-3)
    assert fit.tokens == windows.numel()


def test_a_faithful_model_is_left_alone(tiny):
    ref, cand = _pair(tiny("qwen2"))
    windows = token_windows(3, 24)
    fit = fit_logit_scale(cand, final_hidden(ref, windows), windows)
    assert fit.beta == pytest.approx(1.0, abs=1e-3)
    assert fit.kl_before == pytest.approx(0.0, abs=1e-6)


def test_the_fold_scales_every_logit(tiny):
    ref, cand = _pair(tiny("qwen2"))  # untied LM head
    windows = token_windows(2, 16)
    logits = ref.compute_logits(final_hidden(ref, windows))
    apply_logit_scale(cand, 0.93)
    torch.testing.assert_close(cand.compute_logits(final_hidden(cand, windows)), 0.93 * logits,
                               rtol=1e-5, atol=1e-5)


def test_the_fit_applies_the_soft_cap_as_the_model_does(tiny):
    ref, cand = _pair(tiny("llama"))
    for m in (ref, cand):
        m.config.final_logit_softcapping = 3.0  # small enough to bend these logits
    windows = token_windows(2, 16)
    ref_hidden = final_hidden(ref, windows)
    apply_logit_scale(cand, 0.85)
    hidden = final_hidden(cand, windows)
    betas = torch.tensor([0.9, 1.25], dtype=torch.float64)
    kl, _, _ = kl_curve(cand, ref_hidden, hidden, betas)
    lp = ref.compute_logits(ref_hidden).log_softmax(-1)
    for b, got in zip(betas.tolist(), kl.tolist()):
        lq = cand.compute_logits(hidden * b).log_softmax(-1)  # the cap applied to the scaled logits
        want = float((lp.exp() * (lp - lq)).sum(-1).mean())
        assert got == pytest.approx(want, rel=1e-3)
    # with the cap the factor is not a temperature, and the fit still undoes the fold
    fit = fit_logit_scale(cand, ref_hidden, windows)
    assert fit.beta == pytest.approx(1 / 0.85, abs=5e-3)


def test_refine_finds_the_vertex_and_keeps_edges():
    betas = torch.linspace(0.8, 1.2, 21, dtype=torch.float64)
    assert refine(betas, (betas - 1.013) ** 2) == pytest.approx(1.013, abs=1e-9)
    assert refine(betas, betas) == pytest.approx(0.8)  # minimum on the edge stays there


def test_fit_windows_spread_over_the_calibration_set():
    w = torch.arange(20).view(10, 2)
    assert fit_windows(w, 4)[:, 0].tolist() == [0, 6, 12, 18]
    assert fit_windows(w, 16).shape == (10, 2)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: the exported norm is (1+w)·β − 1
def test_quantize_folds_the_fit_into_the_final_norm_only(tiny, tmp_path, arch):
    """AWQ through `run_quantize`, with the fit (the default) and without: the same codes, the final
    norm differing by the recorded β, and the folders, loaded back, closer to the float model in KL
    on the fit windows with the factor than without it."""
    import json

    from quant_tiny import calibration_text
    from safetensors.torch import load_file

    from turbollm.quantize.calibration import build_calibration
    from turbollm.quantize.methods import QuantizeOptions
    from turbollm.quantize.runner import run_quantize

    calib = calibration_text(tmp_path / "c.txt", words=3000)
    outs, folders = {}, {}
    for fit in (None, False):
        opts = QuantizeOptions(str(tiny(arch)), "awq", tmp_path / f"q-{fit}", group_size=32, calib_samples=8,
                               calib_seq_len=64, calib_data=str(calib), logit_scale=fit, progress=False)
        run_quantize(opts, log=lambda s: None)
        outs[fit], folders[fit] = load_file(str(opts.out / "model.safetensors")), opts.out
    record = json.loads((folders[None] / "config.json").read_text())["quantization_config"]["logit_scale"]
    assert "logit_scale" not in json.loads((folders[False] / "config.json").read_text())["quantization_config"]
    assert record["tokens"] == 8 * 64
    offset = 1.0 if arch == "gemma3" else 0.0  # the checkpoint stores w of x·(1+w)
    for name, t in outs[False].items():
        if name == "model.norm.weight":
            torch.testing.assert_close(outs[None][name] + offset, (t + offset) * record["beta"], rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(outs[None][name], t), name
    ref = load_model(str(tiny(arch)), quantization="none")
    windows = build_calibration(ref.tokenizer, 8, 64, str(calib)).windows
    lp = ref.model.compute_logits(final_hidden(ref.model, windows)).log_softmax(-1)
    kl = {}
    for fit, folder in folders.items():
        m = load_model(str(folder)).model
        lq = m.compute_logits(final_hidden(m, windows)).log_softmax(-1)
        kl[fit] = float((lp.exp() * (lp - lq)).sum(-1).mean())
    assert kl[None] < kl[False]
    assert kl[False] == pytest.approx(record["kl_before"], rel=0.05)  # the loaded model holds its head as Q8_0
