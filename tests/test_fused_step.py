"""The fused decode step (worker/fused_step.py, kernels/csrc/decode_step.cpp) against the module path.

The step runs the module path's kernels on the same tensors in the same order, so it must give
the same bits: greedy tokens and every logprob equal, at batch 1 and batched, for every storage
case it takes (GGUF types with kernels, a QKV of three parts with a dense one, dense float32 with
biases inside the product, the int8 / int4 / int3 layouts with their scales and zero points, a GPTQ
act-order folder's permuted inputs), both block kinds (Llama pre-norm, Gemma 3 sandwich with QK-norm,
MQA, a sliding window), every integer path (q16 by default — blocks of 256 for the k-quants of the
catalog models, whose tests are marked `model`; q8x2 forced; q8 with
`qmatmul="fast"`) and both K/V dtypes. A model it cannot take (a linear method without a
decode product) decodes through the modules and says why; grown RoPE tables rebuild the step.
"""

from __future__ import annotations

import pytest
import torch

from conftest import catalog_model_path
from quant_tiny import build_tiny
from test_gguf_native import TINY_PROMPTS, write_tiny_gguf
from turbollm import LLM, SamplingParams




def _decode(model: str, prompts, *, eager: bool, max_tokens: int = 8, **kw):
    """(token ids, logprobs) of each prompt, and the number of steps that took the fused path."""
    llm = LLM(model, enforce_eager=eager, kv_cache_memory=kw.pop("kv_cache_memory", 1 << 22), threads=2, **kw)
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=4)
    outs = llm.generate(prompts, p, use_tqdm=False)
    alone = llm.generate(prompts[:1], p, use_tqdm=False)  # batch 1 decode as well
    state = llm.engine.executor.worker.runner.fused
    result = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
              for o in outs + alone]
    return result, (state.steps if state is not None else 0), state


def assert_fused_equals_eager(model: str, prompts, **kw) -> None:
    eager, eager_steps, _ = _decode(model, prompts, eager=True, **kw)
    fused, fused_steps, state = _decode(model, prompts, eager=False, **kw)
    assert eager_steps == 0
    assert fused_steps > 0, f"the fused step never ran ({state.unavailable if state else 'no state'})"
    assert fused == eager


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return str(write_tiny_gguf(tmp_path_factory.mktemp("step") / "tiny-mixed.gguf"))


@pytest.mark.parametrize("path", ["auto", "fast", "q8x2"])
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_tiny_gguf_every_part_kind(tiny_gguf, path, kv):
    """QKV of Q4_0 + dense F32 + Q8_0, gate/up Q8_0 + dense (from F16), Q5_0 and Q4_1 layers."""
    assert_fused_equals_eager(tiny_gguf, [{"prompt_token_ids": t} for t in TINY_PROMPTS], kv_cache_dtype=kv,
                              qmatmul=path)


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("qwen2", "float32"), ("gemma3", "float32"),
                                        ("llama", "bfloat16"), ("qwen2", "bfloat16")])
def test_tiny_dense_architectures(tmp_path_factory, arch, dtype):
    """float32 weights (biases inside F.linear for qwen2); gemma3: sandwich norms, QK-norm, MQA, window 16;
    bfloat16 dense weights (engine argument dtype) through the same products in both paths."""
    folder = build_tiny(arch, tmp_path_factory.mktemp(f"step-{arch}"))
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(4, 384, (n,), generator=g).tolist()} for n in (5, 23, 40)]
    assert_fused_equals_eager(str(folder), prompts, max_tokens=12, dtype=dtype)


def test_grown_rope_tables_rebuild_the_step(tmp_path_factory):
    """When the module path replaces the RoPE tables (positions past them), the step is rebuilt."""
    folder = build_tiny("llama", tmp_path_factory.mktemp("step-rope"))
    llm = LLM(str(folder), kv_cache_memory=1 << 22, threads=2)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], p, use_tqdm=False)
    decoder = llm.engine.executor.worker.runner.model.model
    state = llm.engine.executor.worker.runner.fused
    old = state.step
    for layer in decoder.layers:
        layer.self_attn.rotary._grow(2 * layer.self_attn.rotary._cache_len)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], p, use_tqdm=False)
    assert state.step is not old and state.rope_tables[0] is decoder.layers[0].self_attn.rotary.cos


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    return build_tiny("qwen2", tmp_path_factory.mktemp("step-int"))


def _int_prompts():
    g = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(4, 384, (n,), generator=g).tolist()} for n in (6, 19, 33)]


@pytest.mark.parametrize("quantization", ["int8", "int4-g32", "int3-g64"])
@pytest.mark.parametrize("path", ["auto", "fast"])
def test_tiny_integer_layouts(tiny_qwen2, quantization, path):
    """The integer layouts quantized at load (int8 per channel; int4 / int3 with scales and zero
    points per group) on Qwen2's QKV with biases added after the product."""
    assert_fused_equals_eager(str(tiny_qwen2), _int_prompts(), max_tokens=10, quantization=quantization,
                              qmatmul=path)


def test_tiny_gptq_act_order_folder(tiny_qwen2, tmp_path_factory):
    """A GPTQ act-order folder: every linear reads its input columns in the permuted order."""
    from quant_tiny import calibration_text
    from turbollm.quantize.methods import QuantizeOptions
    from turbollm.quantize.runner import run_quantize

    tmp = tmp_path_factory.mktemp("step-gptq")
    out = tmp / "gptq"
    run_quantize(QuantizeOptions(str(tiny_qwen2), "gptq", out, group_size=32, act_order=True, calib_samples=8,
                                 calib_seq_len=64, calib_data=str(calibration_text(tmp / "calib.txt")),
                                 progress=False), log=lambda s: None)
    llm = LLM(str(out), kv_cache_memory=1 << 22, threads=2)
    assert llm.engine.executor.worker.runner.model.model.layers[0].mlp.down_proj.weight_perm is not None
    del llm
    assert_fused_equals_eager(str(out), _int_prompts(), max_tokens=10)


def test_unsupported_method_decodes_through_the_modules(tmp_path_factory, monkeypatch):
    from turbollm.quantization.int8_method import Int8LinearMethod

    monkeypatch.setattr(Int8LinearMethod, "decode_parts", lambda self, layer: None)
    folder = build_tiny("llama", tmp_path_factory.mktemp("step-int8"))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}]
    result, steps, state = _decode(str(folder), prompts, eager=False, quantization="int8")
    assert steps == 0 and "Int8LinearMethod has no fused decode product" in state.unavailable
    assert len(result[0][0]) == 8


@pytest.mark.model
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_catalog_models(name):
    """Real GGUF files: smollm2 (Q4_1 / Q8_0, GQA 3:1), gemma3 (q, k Q5_0 + v Q8_0 parts, MQA, windows)."""
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,"]
    assert_fused_equals_eager(str(catalog_model_path(name)), prompts, max_tokens=6, kv_cache_memory=1 << 26,
                              kv_cache_dtype="float16")


def test_qmatmul_is_per_engine(tiny_gguf):
    """`qmatmul` is an engine argument applied to that engine's model only (before: a process-wide
    default and TURBOLLM_QMATMUL): two engines in one process keep their own numerics."""
    from turbollm.errors import InvalidRequestError

    prompts = [{"prompt_token_ids": t} for t in TINY_PROMPTS]
    exact, _, _ = _decode(tiny_gguf, prompts, eager=False, qmatmul="dequant")
    coarse, _, _ = _decode(tiny_gguf, prompts, eager=False, qmatmul="q8")
    assert exact != coarse  # 8-bit activations round the logprobs
    again, _, _ = _decode(tiny_gguf, prompts, eager=False, qmatmul="dequant")
    assert again == exact
    with pytest.raises(InvalidRequestError, match="qmatmul"):
        LLM(tiny_gguf, qmatmul="int2")


def test_hooks_and_layer_ranges_alike_in_both_paths(tmp_path_factory):
    """The runner's hook points (after each attention and MLP output) are called at the same places by
    the modules and the fused step, and a step run as two layer ranges (a pipeline boundary) equals
    one run: same tokens and logprobs; the hooks do change them."""
    from turbollm.models.forward_batch import LayerHooks

    folder = build_tiny("llama", tmp_path_factory.mktemp("step-hooks"))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [40, 41, 42]}]
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)

    def run(eager: bool, hooked: bool, split: bool = False):
        llm = LLM(str(folder), enforce_eager=eager, kv_cache_memory=1 << 22, threads=2)
        runner = llm.engine.executor.worker.runner
        calls = []
        if hooked:
            def attn_out(layer, t):
                calls.append(("attn", layer))
                t.mul_(0.5)

            def mlp_out(layer, t):
                calls.append(("mlp", layer))
                t.add_(0.01 * (layer + 1))

            runner.hooks = LayerHooks(attn_out, mlp_out)
            if runner.fused is not None:
                runner.fused.hooks = runner.hooks
                llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # built with these
                runner.fused.hooks = runner.hooks = LayerHooks(attn_out, mlp_out)  # a change after the build
                calls.clear()
        if split:
            model = runner.model
            n = len(model.model.layers)

            def run_model(batch):
                x, res = model.embed(batch.input_ids), None
                for start, end in ((0, n // 2), (n // 2, n)):
                    out = runner.fused.forward(x, batch, start, end, res)
                    x, res = out if out is not None else model.run_layers(x, batch, start, end, res)
                return model.final_norm(x, res)

            runner.run_model = run_model
        before = runner.fused.steps if runner.fused is not None else 0
        outs = llm.generate(prompts, p, use_tqdm=False)
        fused_steps = runner.fused.steps - before if runner.fused is not None else 0
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                for o in outs], calls, fused_steps

    eager, eager_calls, _ = run(True, True)
    fused, fused_calls, steps = run(False, True)
    split, _, split_steps = run(False, True, split=True)
    plain, _, _ = run(False, False)
    assert steps > 0 and split_steps == 2 * steps
    assert fused == eager == split and plain != fused
    assert eager_calls == fused_calls and ("attn", 1) in fused_calls and ("mlp", 0) in fused_calls


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_multi_token_steps_run_fused(tmp_path_factory, quantization):
    """Steps where sequences bring several new tokens (short prompts together, chunks of a prompt over
    its cached part: the shape of speculative verification) take the fused step too, with the tiled
    attention kernel, and still equal the module path bit for bit."""
    folder = build_tiny("qwen2", tmp_path_factory.mktemp("step-multi"))
    g = torch.Generator().manual_seed(8)
    prompts = [{"prompt_token_ids": torch.randint(4, 384, (n,), generator=g).tolist()} for n in (3, 4, 23)]

    def run(eager):
        llm = LLM(str(folder), enforce_eager=eager, kv_cache_memory=1 << 22, threads=2, max_num_batched_tokens=8,
                  block_size=8, quantization=quantization)
        runner = llm.engine.executor.worker.runner
        multi = []
        real = runner.run_model

        def watch(batch):
            if not batch.attn.is_pure_decode:
                before = runner.fused.steps if runner.fused is not None else 0
                out = real(batch)
                multi.append((batch.input_ids.numel(), (runner.fused.steps if runner.fused else 0) - before))
                return out
            return real(batch)

        runner.run_model = watch
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
                            use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                for o in outs], multi

    eager, _ = run(True)
    fused, multi = run(False)
    assert fused == eager
    # 3 + 4 + 1 new tokens, then the long prompt's chunks beside two decodes: at most 8 rows, fused
    assert multi and all(n <= 8 and steps == 1 for n, steps in multi), multi
