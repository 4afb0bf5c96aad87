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
from turbollm.kernels import forms

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


def _tails_then_decodes(llm: LLM, prompts: list[list[int]], together: bool) -> tuple[list, list]:
    """Token ids and logprobs of DECODES greedy tokens after each prompt's EXTRA-token tail, the prompts in
    one batch (a first step of PROMPTS x EXTRA rows, then batch-PROMPTS decodes) or each alone; the step
    sizes the runner saw."""
    runner = llm.engine.executor.worker.runner
    steps: list[int] = []
    real_run = runner.run_model

    def spy_run(batch):
        steps.append(batch.input_ids.numel())
        return real_run(batch)

    runner.run_model = spy_run
    params = SamplingParams(temperature=0, max_tokens=DECODES + 1, ignore_eos=True, logprobs=3)
    groups = [prompts] if together else [[p] for p in prompts]
    outs = []
    for group in groups:
        start = len(steps)
        outs += llm.generate([{"prompt_token_ids": p} for p in group], params, use_tqdm=False)
        assert steps[start] == len(group) * EXTRA, f"the tails' step: {steps[start:start + 2]}"
        assert steps[start + 1:] == [len(group)] * DECODES, steps[start + 1:]
    runner.run_model = real_run
    return ([o.outputs[0].token_ids for o in outs],
            [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in outs])


DECODES = 32
FORM_PATHS = [("avx2", "q16"), ("avx2_tiles", "fast"), ("avx512_vnni", "auto"), ("avx512_vnni", "fast")]


@pytest.mark.model
@pytest.mark.parametrize(("form", "qmatmul"), FORM_PATHS, ids=[f"{f}-{q}" for f, q in FORM_PATHS])
def test_catalog_tails_then_decodes_on_every_form(form, qmatmul):
    """gemma3-270m (Q4_K / Q6_K / Q5_0 / Q8_0, full and sliding-window layer groups): 16 prompts whose
    first 32 tokens are cached bring 4-token tails in one step (64 rows), then decode 32 tokens together;
    every token and logprob equals the prompt's run alone, bit for bit. On each kernel form this CPU runs,
    with its numerics for any batch size (avx2: q16 forced, its row kernels; avx512_vnni: the tile
    kernels' q8x2 and q8; avx2_tiles, which gives avx512_vnni's bits: q8)."""
    if form not in forms.runnable_forms():
        pytest.skip(f"this CPU does not run the {form} form")
    llm = LLM(str(catalog_model_path("gemma3-270m")), kv_cache_memory=64 << 20, threads=2, block_size=16,
              enable_prefix_caching=True, kernel_form=form, qmatmul=qmatmul)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 20000, (CACHED + EXTRA,), generator=g).tolist() for _ in range(PROMPTS)]
    llm.generate([{"prompt_token_ids": p[:CACHED]} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    tokens_b, logprobs_b = _tails_then_decodes(llm, prompts, together=True)
    tokens_a, logprobs_a = _tails_then_decodes(llm, prompts, together=False)
    same = sum(ta == tb and la == lb for ta, tb, la, lb in zip(tokens_a, tokens_b, logprobs_a, logprobs_b))
    assert same == PROMPTS, f"{same}/{PROMPTS} prompts alone equal to batched"
