"""The engine under its limits: a tiny KV pool never hangs it, one bad request never fails another,
and an error leaves nothing behind. A tiny random llama checkpoint (tests/quant_tiny.py) keeps it fast."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from quant_tiny import VOCAB, build_tiny
from turbollm import LLM, SamplingParams
from turbollm.engine.llm_engine import LLMEngine
from turbollm.engine_args import EngineArgs
from turbollm.errors import InvalidRequestError
from turbollm.worker import sampler as sampler_module
from turbollm.worker.sampler import Sampler

pytest.importorskip("transformers")

CONTEXT = 256  # the tiny checkpoint's max_position_embeddings
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head dim 16, float32
PROMPT = [5 + (7 * i) % 300 for i in range(10)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny("llama", tmp_path_factory.mktemp("tiny-llama")))


def engine(path: str, **kw) -> LLMEngine:
    kw.setdefault("threads", 1)
    return LLMEngine(EngineArgs(model=path, **kw))


def run(eng: LLMEngine, max_steps: int = 400) -> dict:
    """Step until every request is done (bounded: a step loop that makes no progress fails the test)."""
    done = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return done
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError(f"still unfinished after {max_steps} steps: the engine is not making progress "
                         f"(running {len(eng.scheduler.running)}, waiting {len(eng.scheduler.waiting)})")


@pytest.mark.parametrize("caching", [True, False])
def test_a_request_without_max_tokens_on_a_tiny_pool_finishes(tiny, caching, caplog):
    """Before: max_model_len stayed the model's 256 over a 64-token pool; the sequence outgrew the pool,
    preempted itself, and the scheduler returned empty steps forever (caching on) or looped
    prefill -> preempt (caching off)."""
    with caplog.at_level(logging.WARNING, logger="turbollm"):
        eng = engine(tiny, kv_cache_memory=64 * BYTES_PER_TOKEN, enable_prefix_caching=caching)
    assert eng.kv_config.num_tokens == 64
    assert eng.max_model_len == 64
    assert any("capped to 64 tokens" in r.getMessage() for r in caplog.records)
    eng.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=None, ignore_eos=True, seed=1), "r")
    out = run(eng)["r"].outputs[0]
    assert out.finish_reason == "length" and len(PROMPT) + len(out.token_ids) == 64
    assert eng.kv_manager.num_free == eng.kv_manager.num_blocks


def test_prompt_over_the_capped_context_is_refused(tiny):
    eng = engine(tiny, kv_cache_memory=64 * BYTES_PER_TOKEN)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        eng.add_request({"prompt_token_ids": list(range(4, 4 + 64))}, SamplingParams())


def test_default_kv_cache_is_sized_to_the_context_times_max_num_seqs(tiny):
    """Before: every model got min(4 GiB, a quarter of RAM), even a tiny one with a 256-token context."""
    eng = engine(tiny, max_num_seqs=3)
    assert eng.kv_config.num_tokens == 3 * CONTEXT
    assert eng.max_model_len == CONTEXT
    assert engine(tiny, max_num_seqs=3, max_model_len=100).kv_config.num_tokens == 3 * 112  # whole blocks


def test_stop_token_ids_outside_the_vocabulary_are_refused_and_others_keep_running(tiny):
    """Before: accepted; with min_tokens > 0 the sampler indexed out of range inside step() and every
    request in flight failed with it."""
    eng = engine(tiny)
    eng.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=6, ignore_eos=True, seed=3), "good")
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        eng.add_request({"prompt_token_ids": PROMPT},
                        SamplingParams(max_tokens=6, min_tokens=2, stop_token_ids=[VOCAB + 5]), "bad")
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])
    done = run(eng)
    assert set(done) == {"good"} and len(done["good"].outputs[0].token_ids) == 6


def _alone(tiny, params: SamplingParams) -> list[int]:
    eng = engine(tiny)
    eng.add_request({"prompt_token_ids": PROMPT}, params, "x")
    return run(eng)["x"].outputs[0].token_ids


@pytest.mark.parametrize("where", ["sampler", "detokenizer"])
def test_a_failure_in_one_requests_processing_fails_that_request_only(tiny, monkeypatch, where):
    """Before: any exception in step() failed every request in flight."""
    normal = SamplingParams(max_tokens=8, ignore_eos=True, seed=11, temperature=0.8)
    want = _alone(tiny, normal)
    eng = engine(tiny)
    eng.add_request({"prompt_token_ids": PROMPT}, normal, "good")
    eng.add_request({"prompt_token_ids": PROMPT[::-1]}, SamplingParams(max_tokens=8, ignore_eos=True), "bad")
    if where == "sampler":
        real = sampler_module.apply_penalties_and_masks

        def penalties(logits, rows):  # raises for the "bad" request's rows once it has generated a token
            if any(r.token_ids[:len(PROMPT)] == PROMPT[::-1] and r.output_token_ids for r in rows):
                raise RuntimeError("boom in sampling")
            return real(logits, rows)

        monkeypatch.setattr(sampler_module, "apply_penalties_and_masks", penalties)
        eng.step()  # prefill both
    else:
        eng.step()
        bad_seq = eng.requests["bad"].seqs[0]

        def add(token):
            raise RuntimeError("boom in detokenizing")

        monkeypatch.setattr(bad_seq.detokenizer, "add", add)
    done = run(eng)
    assert done["good"].outputs[0].token_ids == want and done["good"].error is None
    bad = done["bad"]
    assert bad.outputs[0].finish_reason == "error" and "boom" in bad.error
    assert not eng.requests and eng.kv_manager.num_free == eng.kv_manager.num_blocks


def test_extreme_sampling_values_neither_fail_nor_disturb_the_batch(tiny):
    """Before: temperature 1e180 with repetition_penalty 1e308 made NaN probabilities ("probability tensor
    contains inf, nan"), raised inside step() and failed the concurrent normal request too."""
    normal = SamplingParams(max_tokens=8, ignore_eos=True, seed=5, temperature=0.7)
    want = _alone(tiny, normal)
    eng = engine(tiny)
    eng.add_request({"prompt_token_ids": PROMPT}, normal, "normal")
    eng.add_request({"prompt_token_ids": PROMPT},
                    SamplingParams(max_tokens=8, ignore_eos=True, temperature=1e180, repetition_penalty=1e308),
                    "extreme")
    eng.add_request({"prompt_token_ids": PROMPT},
                    SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.5, repetition_penalty=1e-300),
                    "tiny-penalty")
    done = run(eng)
    assert done["normal"].outputs[0].token_ids == want
    for rid in ("extreme", "tiny-penalty"):
        out = done[rid].outputs[0]
        assert done[rid].error is None and out.finish_reason == "length"
        assert all(0 <= t < VOCAB for t in out.token_ids)


def test_sampler_without_a_seed_leaves_the_global_rng_alone():
    """Before: Sampler() called torch.seed(), reseeding the process-wide generator."""
    torch.manual_seed(1234)
    a = torch.rand(4)
    torch.manual_seed(1234)
    Sampler()
    assert torch.equal(torch.rand(4), a)


def test_an_exception_inside_generate_leaves_no_requests_behind(tiny, monkeypatch):
    """Before: the requests of the failed call stayed in the engine and ran inside the next call."""
    llm = LLM(tiny, threads=1)
    executor = llm.engine.executor
    real, calls = executor.execute_model, []

    def flaky(sched):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("forward pass failed")
        return real(sched)

    monkeypatch.setattr(executor, "execute_model", flaky)
    with pytest.raises(RuntimeError, match="forward pass failed"):
        llm.generate([{"prompt_token_ids": PROMPT}] * 3, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert llm.engine.kv_manager.num_free == llm.engine.kv_manager.num_blocks
    outs = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 4


def test_forked_siblings_respect_max_num_seqs(tiny):
    """Before: the n - 1 siblings forked off a prompt joined the running set past max_num_seqs."""
    eng = engine(tiny, max_num_seqs=3)
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        eng.add_request({"prompt_token_ids": PROMPT}, SamplingParams(n=4))
    eng.add_request({"prompt_token_ids": PROMPT}, SamplingParams(n=2, max_tokens=6, ignore_eos=True, seed=2), "a")
    eng.add_request({"prompt_token_ids": PROMPT[:5]}, SamplingParams(n=2, max_tokens=6, ignore_eos=True, seed=2), "b")
    peak, done = 0, {}
    for _ in range(100):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        peak = max(peak, len(eng.scheduler.running))
    assert peak <= 3 and set(done) == {"a", "b"}
    assert all(len(c.token_ids) == 6 for o in done.values() for c in o.outputs)


def test_server_on_a_tiny_pool_answers_instead_of_hanging(tiny):
    """A chat request without max_tokens on a small KV cache (the issue's trigger) finishes at the capped
    context; one asking for more than fits is a 400."""
    httpx = pytest.importorskip("httpx")
    from turbollm.entrypoints.async_engine import AsyncLLMEngine
    from turbollm.server.app import ServerSettings, build_app

    aengine = AsyncLLMEngine(engine(tiny, kv_cache_memory=64 * BYTES_PER_TOKEN))
    app = build_app(aengine, ServerSettings(served_model_names=["tiny"]))

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
            body = {"model": "tiny", "prompt": " ".join(f"w{t}" for t in PROMPT), "max_tokens": None,
                    "ignore_eos": True}
            ok = await asyncio.wait_for(client.post("/v1/completions", json=body), 60)
            over = await client.post("/v1/completions", json={**body, "max_tokens": 60})
            return ok, over

    try:
        ok, over = asyncio.run(go())
    finally:
        aengine.shutdown_sync(timeout=10)
    assert ok.status_code == 200, ok.text
    choice = ok.json()["choices"][0]
    assert choice["finish_reason"] == "length" and ok.json()["usage"]["total_tokens"] == 64
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"


def test_the_final_text_extends_what_was_streamed(tiny):
    """Every intermediate text is a prefix of the final one. Before: the final text was a fresh decode of the
    output alone, while the increments were decoded with the prompt as context; for a vocabulary whose
    decode joins or strips spaces (SentencePiece's leading '▁', this WordLevel one) the final text lost the
    first space the stream had already sent."""
    eng = engine(tiny)
    eng.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0), "r")
    texts = []
    while eng.has_unfinished_requests():
        texts += [o.outputs[0].text for o in eng.step()]
    assert len(texts) == 6 and texts[-1].strip()
    for earlier in texts[:-1]:
        assert texts[-1].startswith(earlier), (earlier, texts[-1])


def _failing_rows(monkeypatch, when):
    """Make the sampler raise for the rows `when(row)` picks (the runner's rows carry seq_id and index)."""
    real = sampler_module.apply_penalties_and_masks

    def penalties(logits, rows):
        if any(when(r) for r in rows):
            raise RuntimeError("boom in sampling")
        return real(logits, rows)

    monkeypatch.setattr(sampler_module, "apply_penalties_and_masks", penalties)


def test_a_forked_siblings_failed_sample_fails_its_request_and_nothing_hangs(tiny, monkeypatch):
    """Before: a sibling's sampling error was dropped (errors were read before the fork created it), the
    sibling sat with every token computed and nothing to run, and the engine stopped making progress."""
    eng = engine(tiny)
    _failing_rows(monkeypatch, lambda r: r.index == 1)
    eng.add_request({"prompt_token_ids": PROMPT}, SamplingParams(n=2, max_tokens=4, ignore_eos=True, seed=1), "pair")
    eng.add_request({"prompt_token_ids": PROMPT[::-1]}, SamplingParams(max_tokens=4, ignore_eos=True), "other")
    done = run(eng)
    assert done["pair"].error and all(c.finish_reason == "error" for c in done["pair"].outputs)
    assert done["other"].error is None and len(done["other"].outputs[0].token_ids) == 4
    assert eng.kv_manager.num_free == eng.kv_manager.num_blocks


def test_siblings_never_forked_leave_no_state_in_the_worker(tiny, monkeypatch):
    """Before: the runner made the siblings' states before sampling; when the parent's first sample failed
    the fork never happened and those states stayed in the worker for good."""
    eng = engine(tiny)
    _failing_rows(monkeypatch, lambda r: r.index == 0 and not r.output_token_ids and r.params.n == 3)
    eng.add_request({"prompt_token_ids": PROMPT}, SamplingParams(n=3, max_tokens=4, ignore_eos=True), "triple")
    assert run(eng)["triple"].error
    eng.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, ignore_eos=True), "next")
    eng.step()  # a step carries the finished ids to the worker
    runner = eng.executor.worker.runner
    assert set(runner.states) == set(eng.scheduler.seqs), (runner.states.keys(), eng.scheduler.seqs.keys())


def test_a_failure_while_forking_ends_the_new_siblings_too(tiny, monkeypatch):
    """Before: with n > 1 and prompt logprobs, a failure processing the parent's update failed only the
    sequences the request had so far; the sibling forked in the same step kept generating."""
    from turbollm.engine.output_processor import OutputProcessor

    def broken(self, seq, plp):
        raise RuntimeError("boom in prompt logprobs")

    monkeypatch.setattr(OutputProcessor, "_record_prompt_logprobs", broken)
    eng = engine(tiny)
    eng.add_request({"prompt_token_ids": PROMPT}, SamplingParams(n=2, max_tokens=6, ignore_eos=True, prompt_logprobs=1,
                                                                 seed=4), "r")
    out = run(eng)["r"]
    assert "boom" in out.error and [c.finish_reason for c in out.outputs] == ["error", "error"]
    assert not eng.scheduler.seqs and eng.kv_manager.num_free == eng.kv_manager.num_blocks


def test_preemption_changes_no_output(tiny):
    """16 requests on a pool that forces preemption (with prefix caching and n = 2) give the same tokens and
    logprobs as on a pool with room for all: the runner's state follows the scheduler through preemption,
    resumption from the prefix cache and copy-on-write."""
    from test_executors import run as run_all, workload

    small = engine(tiny, kv_cache_memory=192 * BYTES_PER_TOKEN, max_num_seqs=8)
    tight = run_all(small, workload())
    assert small.stats()["num_preemptions"] > 0
    roomy = run_all(engine(tiny, max_num_seqs=8), workload())
    assert tight.keys() == roomy.keys()
    for rid in tight:  # tokens, text and finish reasons exactly; logprobs to 1e-4 (a recomputed prompt is a
        (outs_t, plp_t), (outs_r, plp_r) = tight[rid], roomy[rid]  # prefill, the original ran as decodes)
        assert [o[:3] for o in outs_t] == [o[:3] for o in outs_r], rid
        for o_t, o_r in zip(outs_t, outs_r):
            for pos_t, pos_r in zip(o_t[3], o_r[3]):
                assert [t for t, _ in pos_t] == [t for t, _ in pos_r]
                assert [lp for _, lp in pos_t] == pytest.approx([lp for _, lp in pos_r], abs=1e-4)
        assert (plp_t is None) == (plp_r is None)
