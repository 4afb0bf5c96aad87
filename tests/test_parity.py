"""Logits and greedy parity with transformers on real catalog GGUF files (the oracle).

Runs the same check as `turbollm eval parity` on the two smallest architectures that
differ most (llama with GQA; gemma3 with MQA, QK-norm, sliding windows). The qwen2 models
are checked by the same command and recorded in docs/BENCHMARKS.md (too slow for CI).
"""

from __future__ import annotations

import pytest

from conftest import catalog_model_path
from turbollm.eval.parity import run_parity
from turbollm.eval.prompts import PARITY_PROMPTS

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_parity_with_transformers(name):
    pytest.importorskip("transformers")
    from turbollm.loader import load_model

    # The exact path: transformers dequantizes the GGUF to fp32, so does "none" (tests/test_gguf_native.py
    # holds the default "gguf" path to this one).
    loaded = load_model(str(catalog_model_path(name)), quantization="none")
    report = run_parity(loaded, PARITY_PROMPTS, gen_tokens=32)
    for p in report.prompts:
        assert p.top1_mismatches == 0, p
        assert p.max_top5_diff < 0.01 and p.max_top5_diff_batched < 0.01, p
        assert p.greedy_ok, p
    assert {p.name for p in report.prompts} == set(PARITY_PROMPTS)
