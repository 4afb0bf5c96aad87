"""Row invariance of the decode / small-query path: a sequence's logits do not depend on the rows
that share its step.

Each of 16 prompts has its first 32 tokens in the prefix cache (two full blocks, computed once);
then the logits after its last token are computed three ways: alone (a one-token step), in one
step with the 15 others (a batch-16 decode), and as the first row of a 5-token step of its own
(the prompt's last token followed by 4 more: the shape of speculative verification; the runner
samples only that step's last row, so its first row is compared by its final hidden state, from
which the one-row LM head product gives the alone logits). The three must be the same bits, for
every weight storage kind the fast path
takes: GGUF block types with 16-bit activations (q16) and two 8-bit levels (q8x2), one 8-bit level
(`fast`), dense float32 and float16-from-GGUF parts, the int8 / int4 / int3 layouts, and the
catalog's k-quants with sliding-window layers (gemma3-270m, marked `model`). What makes it hold:
the quantized and dense matmuls compute each row alone up to 16 rows (one accumulation order per
row whatever the rows beside it), and steps where no sequence brings more than 8 tokens attend one
decode per token (kernels/csrc/paged_attention.cpp).
"""

from __future__ import annotations

import pytest
import torch

from conftest import catalog_model_path
from quant_tiny import build_tiny
from test_gguf_native import write_tiny_gguf
from turbollm import LLM, SamplingParams

PROMPTS, CACHED, EXTRA = 16, 32, 4


def _rows_three_ways(model: str, vocab: int, **kw) -> tuple[list, list, list]:
    llm = LLM(model, kv_cache_memory=kw.pop("kv_cache_memory", 1 << 24), threads=2, block_size=16,
              enable_prefix_caching=True, **kw)
    runner = llm.engine.executor.worker.runner
    calls: list[torch.Tensor] = []  # logits of the sampled rows of each step
    hidden: list[torch.Tensor] = []  # the final hidden states of every new token of each step
    steps: list[int] = []  # new tokens of each step
    real_logits, real_run = runner.model.compute_logits, runner.run_model

    def spy_logits(h):
        out = real_logits(h)
        calls.append(out.clone())
        return out

    def spy_run(batch):
        steps.append(batch.input_ids.numel())
        out = real_run(batch)
        hidden.append(out.clone())
        return out

    runner.model.compute_logits, runner.run_model = spy_logits, spy_run
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (CACHED + 1,), generator=g).tolist() for _ in range(PROMPTS)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def run(reqs, new_tokens):
        calls.clear()
        hidden.clear()
        steps.clear()
        llm.generate([{"prompt_token_ids": r} for r in reqs], one, use_tqdm=False)
        assert steps == [new_tokens], f"expected one step of {new_tokens} new tokens over cached prefixes: {steps}"
        return calls[0], hidden[0]

    for p in prompts:  # the 16 cached prefixes (two full blocks each), each computed alone
        run([p[:CACHED]], CACHED)
    alone = [run([p], 1) for p in prompts]  # one-token steps over the cached prefix
    batched = run(prompts, PROMPTS)  # the 16 in one decode-shaped step
    five = []  # the prompt's last token + EXTRA more: its row is the first of the step
    for p in prompts:
        five.append(run([p + torch.randint(3, vocab, (EXTRA,), generator=g).tolist()], 1 + EXTRA)[1][0])
    return ([(lg[0], h[0]) for lg, h in alone], list(zip(batched[0], batched[1])), five)


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"max |difference| {float((a - b).abs().max()):.3g}"


def assert_row_invariant(model: str, vocab: int, **kw) -> None:
    """Logits and final hidden state of each prompt's next position: alone == in the batch of 16; hidden
    state alone == as the first row of the 5-token step (whose logits are those of that hidden state
    through the same one-row LM head product, computed alone)."""
    alone, batched, five = _rows_three_ways(model, vocab, **kw)
    for i, ((la, ha), (lb, hb), hf) in enumerate(zip(alone, batched, five)):
        assert torch.equal(ha, hb), f"prompt {i}: its row in the batch of 16 differs from alone, {_diff(ha, hb)}"
        assert torch.equal(la, lb), f"prompt {i}: its logits in the batch of 16 differ from alone, {_diff(la, lb)}"
        assert torch.equal(ha, hf), f"prompt {i}: first row of the 5-token step differs from alone, {_diff(ha, hf)}"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return str(write_tiny_gguf(tmp_path_factory.mktemp("rowinv") / "tiny-mixed.gguf"))


@pytest.mark.parametrize("qmatmul", ["auto", "q8x2", "fast"])
def test_gguf_block_types(tiny_gguf, qmatmul):
    """Q4_0, Q5_0, Q4_1, Q8_0 (also the tied LM head), a dense F32 part and an F16 one (decoded to dense)."""
    assert_row_invariant(tiny_gguf, 32, qmatmul=qmatmul)


@pytest.mark.parametrize("quantization", [None, "int8", "int4-g32", "int3-g64"])
def test_dense_and_integer_layouts(tmp_path_factory, quantization):
    folder = build_tiny("qwen2", tmp_path_factory.mktemp("rowinv-int"))
    assert_row_invariant(str(folder), 384, quantization=quantization)


@pytest.mark.model
def test_catalog_k_quants_and_sliding_windows():
    """gemma3-270m: Q4_K / Q6_K and Q5_0 / Q8_0 (q16 in blocks of 256 and of 32), full and sliding-window
    layer groups."""
    assert_row_invariant(str(catalog_model_path("gemma3-270m")), 20000, kv_cache_memory=64 << 20)
