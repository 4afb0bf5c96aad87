"""Greedy output does not depend on batching, prefix caching, chunked prefill or preemption.

The rule (DESIGN.md §5): identical token ids, except from the step where the two runs first part,
if the tokens they picked there were a near-tie: top-1/top-2 logprob margin below 0.01 (there fp32
rounding may pick the other token; see `assert_same_greedy`). Set
TURBOLLM_FULL_ACCEPTANCE=1 for the issue's full setting (16 prompts of 8..600 tokens).
"""

from __future__ import annotations

import os

import pytest

from conftest import SHARED_DATA, catalog_model_path
from turbollm import LLM, SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.slow]
FULL = os.environ.get("TURBOLLM_FULL_ACCEPTANCE") == "1"
MARGIN = 0.01
# The rule above is about fp32 rounding: pin the exact path. The default "gguf" path picks its
# kernel by token count (q8 activations for <= 32 tokens, exact above), so a prompt computed
# alone and in a batch may differ by more than rounding there (tests/test_gguf_native.py bounds it).
QUANT = "none"


def _prompts(llm: LLM, count: int, lengths: list[int]) -> list[list[int]]:
    """Token-id prompts of the given lengths, cut from WikiText-2 (no calibration: pure input)."""
    text = (SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[:200_000]
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    out, pos = [], 0
    for i in range(count):
        n = lengths[i % len(lengths)]
        out.append(ids[pos:pos + n])
        pos += n + 17
    return out


def _run(llm: LLM, prompts, max_tokens: int):
    """Greedy completions of `prompts`, one per prompt, each exactly `max_tokens` long (ignore_eos)."""
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)
    assert len(outs) == len(prompts) and all(o.finished and len(o.outputs) == 1 for o in outs)
    assert all(len(o.outputs[0].token_ids) == len(o.outputs[0].logprobs) == max_tokens for o in outs)
    return [o.outputs[0] for o in outs]


def _tie_margin(chooser, other_token: int, step: int) -> float:
    """How far `chooser` preferred its own (top-1) token at `step` over `other_token`, the one the
    other run picked there: the difference of their logprobs in chooser's entry, or inf when
    `other_token` is not in it. With logprobs=2 an entry holds a run's top two tokens, so a near-tie
    between the two picks shows in it (unless a third token came between them: no excuse then)."""
    entry = chooser.logprobs[step]
    theirs = entry.get(other_token)
    return float("inf") if theirs is None else entry[chooser.token_ids[step]].logprob - theirs.logprob


def first_divergence(a, b) -> int | None:
    """The first step where two equally long token sequences differ, or None."""
    assert len(a.token_ids) == len(b.token_ids) == len(a.logprobs) == len(b.logprobs), \
        (len(a.token_ids), len(b.token_ids), len(a.logprobs), len(b.logprobs))
    return next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)


def assert_same_greedy(ref, other, what: str, margin: float = MARGIN) -> None:
    """Every prompt has an output in both runs, of the same length, with identical token ids, except
    that two runs may part at a step where the two tokens they picked were a near-tie (top-1 minus
    top-2 logprob below `margin`, in either run): fp32 rounding may pick either there. That excuses
    only that exact step; once parted nothing later is compared (the contexts differ)."""
    assert len(ref) == len(other), f"{what}: {len(other)} outputs for {len(ref)} prompts"
    for i, (a, b) in enumerate(zip(ref, other)):
        first = first_divergence(a, b)
        if first is None:
            continue
        tie = min(_tie_margin(a, b.token_ids[first], first), _tie_margin(b, a.token_ids[first], first))
        assert tie < margin, (f"{what}: prompt {i} diverges at step {first} ({a.token_ids[first]} vs "
                              f"{b.token_ids[first]}) with no near-tie there (margin {tie:.4f})")


@pytest.fixture(scope="module")
def model_path():
    return str(catalog_model_path("smollm2-135m"))


def test_alone_batched_prefix_chunked_agree(model_path):
    count, lengths, gen = (16, [8, 40, 120, 250, 400, 600, 16, 80], 24) if FULL else (8, [8, 40, 120, 250], 12)
    llm = LLM(model_path, kv_cache_memory=512 << 20, threads=1, quantization=QUANT)
    prompts = _prompts(llm, count, lengths)
    alone = [_run(llm, [q], gen)[0] for q in prompts]
    assert_same_greedy(alone, _run(llm, prompts, gen), "batched (prefix caching on, cache warm)")
    llm_nocache = LLM(model_path, kv_cache_memory=512 << 20, enable_prefix_caching=False, threads=1, quantization=QUANT)
    assert_same_greedy(alone, _run(llm_nocache, prompts, gen), "batched, prefix caching off")
    llm_chunked = LLM(model_path, kv_cache_memory=512 << 20, max_num_batched_tokens=64, threads=1, quantization=QUANT)
    assert_same_greedy(alone, _run(llm_chunked, prompts, gen), "max_num_batched_tokens=64 (chunked prefill)")
    assert llm.engine.kv_manager.stats.hits > 0  # the batched run re-used the prompts computed alone


def test_small_pool_preempts_and_still_finishes_everything(model_path):
    prompts_llm = LLM(model_path, kv_cache_memory=256 << 20, threads=1, quantization=QUANT)
    prompts = _prompts(prompts_llm, 6, [20, 30])
    ref = _run(prompts_llm, prompts, 32)
    # 6 requests of ~60 tokens need ~24 blocks of 16; give the pool 10
    per_block = prompts_llm.engine.kv_config.bytes_per_token * 16
    small = LLM(model_path, kv_cache_memory=10 * per_block, enable_prefix_caching=False, threads=1, quantization=QUANT)
    got = _run(small, prompts, 32)
    assert small.engine.scheduler.num_preemptions > 0
    assert all(len(c.token_ids) == 32 for c in got)
    assert_same_greedy(ref, got, "preempted run")
    assert small.engine.kv_manager.num_used == 0


def test_n2_shares_the_prompt_with_copy_on_write(model_path):
    llm = LLM(model_path, kv_cache_memory=128 << 20, threads=1, quantization=QUANT)
    prompt = "The history of the city begins with"  # a partial last block: shared, then copied
    greedy = llm.generate([prompt], SamplingParams(temperature=0, n=2, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0]
    single = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == single.outputs[0].token_ids
    sampled = llm.generate([prompt], SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=10, ignore_eos=True),
                           use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    assert llm.engine.kv_manager.num_used == 0


def test_shared_system_prompt_hits_the_prefix_cache(model_path):
    llm = LLM(model_path, kv_cache_memory=128 << 20, threads=1, quantization=QUANT)
    system = "You are a careful assistant who answers briefly. " * 12
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([system + "Question one?"], p, use_tqdm=False)[0]
    stats = llm.engine.kv_manager.stats
    hits_before = stats.hits
    second = llm.generate([system + "Question two?"], p, use_tqdm=False)[0]
    shared = len(first.prompt_token_ids) - 8
    assert stats.hits - hits_before >= (shared // 16) * 16 - 16
    nocache = LLM(model_path, kv_cache_memory=128 << 20, enable_prefix_caching=False, threads=1, quantization=QUANT)
    assert nocache.generate([system + "Question two?"], p, use_tqdm=False)[0].outputs[0].token_ids == \
        second.outputs[0].token_ids


def test_float16_kv_cache_holds_twice_the_tokens_and_keeps_greedy(model_path):
    """kv_cache_dtype="float16": half the bytes per token, the same budget holds twice the tokens,
    and greedy decoding follows the float32 cache (fp16 storage rounds K/V to 11 significant bits,
    so the near-tie margin here is 0.05 rather than fp32's 0.01)."""
    import torch

    from turbollm.errors import InvalidRequestError

    llm32 = LLM(model_path, kv_cache_memory=128 << 20, threads=1, quantization=QUANT)
    llm16 = LLM(model_path, kv_cache_memory=128 << 20, threads=1, quantization=QUANT, kv_cache_dtype="float16")
    assert llm16.engine.kv_config.dtype == torch.float16
    assert llm16.engine.kv_config.num_tokens == 2 * llm32.engine.kv_config.num_tokens
    prompts = _prompts(llm32, 3, [40, 250, 600])
    ref, got = _run(llm32, prompts, 24), _run(llm16, prompts, 24)
    assert_same_greedy(ref, got, "float16 KV cache", margin=0.05)
    for a, b in zip(ref, got):  # up to where they part (if they do), the chosen tokens' logprobs agree
        n = first_divergence(a, b)
        n = len(a.token_ids) if n is None else n
        diffs = [abs(a.logprobs[j][a.token_ids[j]].logprob - b.logprobs[j][a.token_ids[j]].logprob) for j in range(n)]
        assert max(diffs, default=0.0) < 0.02
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        LLM(model_path, kv_cache_dtype="int3")
