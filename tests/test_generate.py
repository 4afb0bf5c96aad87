"""The first generate path: LLM(...).generate with vLLM-shaped outputs, on smollm2-135m."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import catalog_model_path
from turbollm import LLM, SamplingParams
from turbollm.outputs import Logprob

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "def add(a, b):", "中文和 emoji 🚀 混合的句子："]


@pytest.fixture(scope="module")
def llm():
    # quantization="none": these tests hold a request alone and in a batch to identical tokens, which
    # only the exact fp32 path guarantees; the default "gguf" path quantizes activations to 8 bits
    # (q8) for small batches, and that amplifies rounding differences between batch shapes
    # (tests/test_gguf_native.py bounds it against fp32).
    return LLM(str(catalog_model_path("smollm2-135m")), seed=0, kv_cache_memory=256 << 20, quantization="none")


def test_request_output_shape(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert len(outs) == len(PROMPTS)
    for prompt, o in zip(PROMPTS, outs):
        assert o.prompt == prompt and o.finished
        assert o.prompt_token_ids == llm.get_tokenizer().encode(prompt)
        c = o.outputs[0]
        assert 1 <= len(c.token_ids) <= 12
        assert c.finish_reason in ("stop", "length")
        assert c.text == llm.get_tokenizer().decode(
            [t for t in c.token_ids if t not in llm.get_tokenizer().eos_token_ids], skip_special_tokens=True)


def test_greedy_same_alone_and_batched(llm):
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)]
    alone = [llm.generate([q], p, use_tqdm=False)[0].outputs[0].token_ids for q in PROMPTS]
    assert batched == alone


def test_chunked_prefill_matches_one_shot(llm):
    long_prompt = " ".join(f"item {i}," for i in range(80))
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one_shot = llm.generate([long_prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    sched = llm.engine.scheduler
    saved = sched.max_num_batched_tokens
    sched.max_num_batched_tokens = 37  # force several prefill chunks
    try:
        chunked = llm.generate([long_prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        sched.max_num_batched_tokens = saved
    assert chunked == one_shot


def test_prompt_logprobs_vllm_format(llm):
    k = 3
    out = llm.generate(["One two three four five"], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k),
                       use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(out.prompt_token_ids) and plp[0] is None
    for pos, entry in enumerate(plp[1:], start=1):
        tok = out.prompt_token_ids[pos]
        assert tok in entry and isinstance(entry[tok], Logprob)
        assert len(entry) in (k, k + 1)
        ranks = sorted(lp.rank for t, lp in entry.items() if t != tok or entry[t].rank <= k)
        assert ranks[:k] == list(range(1, k + 1))
        # logprobs are a distribution's: the top-1 is the largest, all are <= 0
        top1 = next(lp for lp in entry.values() if lp.rank == 1)
        assert all(lp.logprob <= top1.logprob + 1e-6 and lp.logprob <= 0 for lp in entry.values())
        assert entry[tok].decoded_token == llm.get_tokenizer().decode([tok])


def test_prompt_logprobs_complete_when_the_prompt_is_cached(llm):
    p = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    prompt = "A prompt long enough to fill more than one block of the KV cache, twice over, " * 2
    first = llm.generate([prompt], p, use_tqdm=False)[0].prompt_logprobs
    second = llm.generate([prompt], p, use_tqdm=False)[0].prompt_logprobs  # its blocks are cached now
    assert len(second) == len(first) and second[0] is None and all(e is not None for e in second[1:])
    assert [sorted(e) for e in second[1:]] == [sorted(e) for e in first[1:]]


def test_prompt_logprobs_match_a_direct_forward(llm):
    from turbollm.eval.parity import score

    out = llm.generate(["Paris is the capital of"], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids
    logits = score(llm.engine.loaded, [ids])[0].log_softmax(-1)
    for pos in range(1, len(ids)):
        assert math.isclose(out.prompt_logprobs[pos][ids[pos]].logprob, float(logits[pos - 1, ids[pos]]), abs_tol=1e-4)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=1234, ignore_eos=True)
    a = llm.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(PROMPTS, p, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
    c = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=99,
                                                  ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert c != a


def test_stop_string_and_max_tokens(llm):
    """A stop string taken from the middle of the model's own greedy output (so it surely occurs)
    cuts the output right before its first occurrence: text = the greedy text up to it, tokens = the
    greedy tokens up to the one that completed it, finish_reason "stop", stop_reason the string.
    Then max_tokens ends a request with finish_reason "length" after exactly that many tokens."""
    prompt, tok = "Write a sentence about cats", llm.get_tokenizer()
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = free.text
    # the first 6-character window from the middle on that starts a word and occurs nowhere earlier
    at = next((i for i in range(len(text) // 2, len(text) - 6)
               if text[i - 1] == " " and not text[i].isspace() and text.find(text[i:i + 6]) == i), None)
    assert at is not None, f"no usable stop string in the second half of {text!r}"
    stop = text[at:at + 6]
    c = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:at]
    n = len(c.token_ids)
    assert n < len(free.token_ids) and c.token_ids == free.token_ids[:n]
    assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])
    c = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5


def test_n_samples_and_logprobs(llm):
    p = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=7, logprobs=2, ignore_eos=True)
    out = llm.generate(["Once upon a time"], p, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 6
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and 2 <= len(entry) <= 3
        assert math.isclose(c.cumulative_logprob, sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)),
                            rel_tol=1e-5)


def test_kv_blocks_return_to_pool(llm):
    pool = llm.engine.kv_manager
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert pool.num_used == 0 and not llm.engine.has_unfinished_requests()


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(temperature=0, max_tokens=8),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hi"}]),
                                              add_special_tokens=False)
    assert out.outputs[0].token_ids


def test_torch_threads_untouched_by_default():
    """An engine built (and stepped) without `threads` leaves torch's thread count exactly as it was:
    set to a value no default could pick (one more than torch's own), it is still that value after."""
    before = torch.get_num_threads()
    known = before + 1
    torch.set_num_threads(known)
    try:
        llm = LLM(str(catalog_model_path("smollm2-135m")), kv_cache_memory=16 << 20, quantization="none")
        llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        assert torch.get_num_threads() == known
    finally:
        torch.set_num_threads(before)
