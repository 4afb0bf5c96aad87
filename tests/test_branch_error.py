"""`eval branches`: each residual branch's output error against the reference, charged to that branch.

Tiny generated models (quant_tiny.py). The errors are computed on the reference's own residual
stream, so a change to one branch must show there and nowhere else; scales folded inside a branch
must show nowhere; the gain must read a uniform shrink of a branch's output exactly.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from quant_tiny import calibration_text, token_windows  # noqa: E402
from quant_tiny import one_thread_exact_matmul, tiny  # noqa: E402,F401 (fixtures)
from turbollm.eval.branch_error import branch_errors, summarize  # noqa: E402
from turbollm.eval.perplexity import EvalError  # noqa: E402
from turbollm.loader import load_model  # noqa: E402
from turbollm.models.branches import get_adapter  # noqa: E402
from turbollm.quantization.scale_folding import fold_scales  # noqa: E402

WINDOWS = token_windows(4, 40)


def _pair(folder, candidate="none"):
    return load_model(str(folder), quantization="none"), load_model(str(folder), quantization=candidate)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_identical_models_have_no_error(tiny, arch):
    ref, cand = _pair(tiny(arch))
    errors = branch_errors(ref.model, cand.model, WINDOWS, progress=False)
    assert [(e.layer, e.branch) for e in errors] == [(0, "self_attn"), (0, "mlp"), (1, "self_attn"), (1, "mlp")]
    assert all(e.rel_error == 0.0 and e.gain == 0.0 and e.tokens == WINDOWS.numel() for e in errors)


def test_a_scaled_branch_is_charged_to_that_branch_alone(tiny):
    ref, cand = _pair(tiny("qwen2"))
    layers = cand.model.model.layers
    layers[0].self_attn.o_proj.weight.data.mul_(0.9)  # layer 0's attention writes 0.9 y
    layers[1].mlp.down_proj.weight.data.mul_(1.05)  # layer 1's MLP writes 1.05 y
    errors = {(e.layer, e.branch): e for e in branch_errors(ref.model, cand.model, WINDOWS, progress=False)}
    assert errors[0, "self_attn"].gain == pytest.approx(-0.1, abs=1e-5)
    assert errors[0, "self_attn"].rel_error == pytest.approx(0.01, abs=1e-5)
    assert errors[1, "mlp"].gain == pytest.approx(0.05, abs=1e-5)
    assert errors[1, "mlp"].rel_error == pytest.approx(0.0025, abs=1e-6)
    assert errors[0, "mlp"].rel_error == 0.0 and errors[1, "self_attn"].rel_error == 0.0
    summary = summarize(list(errors.values()))
    assert summary["self_attn"]["negative_gain_layers"] == 1 and summary["mlp"]["negative_gain_layers"] == 0
    assert summary["self_attn"]["min_gain"] == pytest.approx(-0.1, abs=1e-5)


def test_errors_are_measured_on_the_reference_stream(tiny):
    """A change upstream must not move a later branch's figures: every branch reads the reference's
    residual stream (else layer 1 would also be charged for layer 0's error)."""
    ref, cand = _pair(tiny("qwen2"))
    g = torch.Generator().manual_seed(5)
    down = cand.model.model.layers[1].mlp.down_proj.weight.data
    down.add_(0.05 * torch.randn(down.shape, generator=g) * down.std())  # an input-dependent error
    alone = branch_errors(ref.model, cand.model, WINDOWS, progress=False)
    cand.model.model.layers[0].self_attn.o_proj.weight.data.mul_(0.5)
    both = branch_errors(ref.model, cand.model, WINDOWS, progress=False)
    assert alone[3].rel_error > 0 and both[0].rel_error > 0.2
    assert (both[3].rel_error, both[3].gain) == (alone[3].rel_error, alone[3].gain)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_scales_folded_inside_branches_are_invisible(tiny, arch):
    ref, cand = _pair(tiny(arch))
    g = torch.Generator().manual_seed(3)
    adapter = get_adapter(cand.config.arch)
    with torch.no_grad():
        for layer in cand.model.model.layers:
            for br in adapter.branches(layer):
                feeder_rows = br.feeder.stop - br.feeder.start
                s1 = torch.rand(br.first.in_features, generator=g) * 1.5 + 0.5
                s2 = torch.rand(feeder_rows, generator=g) * 1.5 + 0.5
                fold_scales(br, s1, s2)
    errors = branch_errors(ref.model, cand.model, WINDOWS, progress=False)
    assert max(e.rel_error for e in errors) < 1e-9
    assert max(abs(e.gain) for e in errors) < 1e-5


def test_quantized_candidate_and_mismatched_models(tiny):
    ref, cand = _pair(tiny("llama"), "int4-g32")
    errors = branch_errors(ref.model, cand.model, WINDOWS, progress=False)
    assert all(0.0 < e.rel_error < 0.5 for e in errors)
    other = load_model(str(tiny("qwen2")), quantization="none")
    with pytest.raises(EvalError, match="qwen2 model and the reference a llama model"):
        branch_errors(ref.model, other.model, WINDOWS, progress=False)


def test_cli_prints_and_writes_the_record(tiny, tmp_path, capsys):
    from turbollm.cli.main import main

    out = tmp_path / "branches.json"
    text = calibration_text(tmp_path / "calib.txt")
    assert main(["eval", "branches", str(tiny("llama")), "--candidate", "int8", "--data", str(text), "--samples", "3",
                 "--seq-len", "32", "--threads", "1", "--no-progress", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["candidate_quantization"] == "int8" and record["samples"] == 3 and record["seq_len"] == 32
    assert len(record["branches"]) == 4 and set(record["summary"]) == {"self_attn", "mlp"}
    assert all(b["rel_error"] > 0 for b in record["branches"])
    printed = capsys.readouterr().out
    assert "self_attn gain" in printed and "negative in" in printed
    assert main(["eval", "branches", str(tiny("llama")), "--candidate", "int8", "--data", str(text),
                 "--samples", "500", "--seq-len", "32", "--no-progress"]) == 1  # corpus too small: one clear line
    assert "too small" in capsys.readouterr().err
