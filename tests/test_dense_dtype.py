"""The dense weights' dtype (quantization/dense_dtype.py): names, "auto" by CPU and model, and a model's dense
weights held in bfloat16 (the tied table once) with outputs near float32's. The fused step's bits against the
module path in bfloat16: tests/test_fused_step.py; every pair with the other techniques: test_engine_config.py."""

from __future__ import annotations

import pytest
import torch

from quant_tiny import build_tiny
from turbollm.engine_args import kv_cache_torch_dtype
from turbollm.errors import InvalidRequestError
from turbollm.loader import load_model
from turbollm.quantization.dense_dtype import check_dtype, dense_linears, resolve_dtype, set_dtype

pytestmark = pytest.mark.usefixtures("needs_kernels")


def test_names():
    for name in ("auto", "float32", "bfloat16", "bf16"):
        assert check_dtype(name) == name
    with pytest.raises(InvalidRequestError, match="float16 compute has no fast path"):
        check_dtype("half")
    with pytest.raises(InvalidRequestError, match="choose one of auto, float32"):
        check_dtype("int8")


def test_auto_kv_is_float16_beside_bfloat16_weights():
    assert kv_cache_torch_dtype("auto", "none", "float32") == torch.float32  # the exact reference
    assert kv_cache_torch_dtype("auto", "none", "bfloat16") == torch.float16
    assert kv_cache_torch_dtype("auto", "gguf", "float32") == torch.float16
    assert kv_cache_torch_dtype("float32", "none", "bf16") == torch.float32  # asked for: kept


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny("llama", tmp_path_factory.mktemp("bf16")))  # tied embeddings


def test_auto_follows_the_cpu_and_the_weights(tiny):
    dense = load_model(tiny).model
    assert resolve_dtype("auto", dense, flags="avx2 fma avx512_bf16") == torch.bfloat16
    assert resolve_dtype("auto", dense, flags="avx2 fma amx_bf16 amx_tile") == torch.bfloat16
    assert resolve_dtype("auto", dense, flags="avx2 fma avx512f avx512_vnni") == torch.float32
    assert resolve_dtype("float32", dense, flags="avx512_bf16") == torch.float32
    assert resolve_dtype("bfloat16", dense, flags="avx2") == torch.bfloat16  # asked: taken (with a warning)
    quantized = load_model(tiny, quantization="int8-rtn").model
    assert not dense_linears(quantized)
    assert resolve_dtype("auto", quantized, flags="avx512_bf16") == torch.float32  # nothing dense to gain


def test_set_dtype_holds_every_dense_weight_once_and_stays_near_float32(tiny):
    ref, model = load_model(tiny).model, load_model(tiny).model
    version = model.weights_version
    assert set_dtype(model, torch.bfloat16) and model.weights_version == version + 1
    assert not set_dtype(model, torch.bfloat16)  # nothing left to convert
    assert all(m.weight.dtype == torch.bfloat16 for m in dense_linears(model))
    head, emb = model.lm_head.weight, model.model.embed_tokens.weight
    assert head is emb and head.dtype == torch.bfloat16  # the tied table: one tensor, converted once
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n)
    windows = torch.arange(5, 45).unsqueeze(0)
    with torch.no_grad():
        a = ref.compute_logits(ref.forward_windows(windows))
        b = model.compute_logits(model.forward_windows(windows))
    assert b.dtype == torch.float32
    rel = ((a - b).norm() / a.norm()).item()
    # bfloat16's rounding, and only that: 0.0199 and 0.0201 on this random tiny model under two float32 summation
    # orders of the attention (2026-12-07); a wrong or missing conversion lands near 1 or under 1e-5
    assert 1e-5 < rel < 3e-2, rel
    with pytest.raises(InvalidRequestError, match="float32 or bfloat16 only"):
        set_dtype(model, torch.float16)
