"""AsyncLLMEngine: concurrent streams over one LLMEngine, aborts, errors, shutdown; DeltaTracker.

No pytest-asyncio: each test runs its coroutine with `asyncio.run`. One LLM (one loaded
model) serves the module; each test wraps its LLMEngine in a fresh AsyncLLMEngine and shuts
it down, after which the LLMEngine is usable directly again.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import catalog_model_path
from turbollm import LLM, SamplingParams
from turbollm.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError
from turbollm.entrypoints.streaming import DeltaTracker
from turbollm.errors import InvalidRequestError
from turbollm.outputs import CompletionOutput, RequestOutput

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,",
           "The best way to learn Python is", "import numpy as", "Roses are red,",
           "中文和 emoji 🚀 混合的句子："]
GREEDY8 = SamplingParams(temperature=0, max_tokens=8)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    # quantization="none": these tests hold a request alone and in a batch to identical tokens, which
    # only the exact fp32 path guarantees; the default "gguf" path quantizes activations to 8 bits
    # (q8) for small batches, and that amplifies rounding differences between batch shapes
    # (tests/test_gguf_native.py bounds it against fp32).
    return LLM(str(catalog_model_path("smollm2-135m")), threads=1, seed=0, kv_cache_memory=64 << 20,
               quantization="none")


def run_wrapped(llm, body, **shutdown_kw):
    """asyncio.run(body(aengine)) with a fresh AsyncLLMEngine over llm.engine, always shut down."""

    async def main():
        aengine = AsyncLLMEngine(llm.engine)
        try:
            return await body(aengine)
        finally:
            await aengine.shutdown(**shutdown_kw)

    result = asyncio.run(main())
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_manager.num_used == 0
    return result


async def collect(aengine, prompt, params, request_id=None):
    outs = []
    async for out in aengine.generate(prompt, params, request_id):
        outs.append(out)
    return outs


async def wait_for(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------ model tests
@pytest.mark.model
def test_concurrent_greedy_equals_offline(llm):
    alone = [llm.generate([p], GREEDY8, use_tqdm=False)[0] for p in PROMPTS]

    async def body(aengine):
        return await asyncio.gather(*(collect(aengine, p, GREEDY8, f"r{i}") for i, p in enumerate(PROMPTS)))

    streams = run_wrapped(llm, body)
    for p, ref, outs in zip(PROMPTS, alone, streams):
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        assert final.prompt == p and final.prompt_token_ids == ref.prompt_token_ids
        assert final.outputs[0].token_ids == ref.outputs[0].token_ids, p
        assert final.outputs[0].text == ref.outputs[0].text
        assert final.outputs[0].finish_reason == ref.outputs[0].finish_reason


@pytest.mark.model
def test_streaming_deltas_add_up(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def body(aengine):
        return await asyncio.gather(collect(aengine, PROMPTS[0], params), collect(aengine, PROMPTS[7], params))

    for outs in run_wrapped(llm, body):
        assert len(outs) > 1  # tokens arrive incrementally
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and lengths[0] < lengths[-1] == 12
        tracker = DeltaTracker()
        text, ids = "", []
        for o in outs:
            for d in tracker.update(o):
                text += d.text
                ids += d.token_ids
        assert text == outs[-1].outputs[0].text and ids == outs[-1].outputs[0].token_ids


@pytest.mark.model
def test_slow_reader_gets_newest_output(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def body(aengine):
        stream = aengine.generate(PROMPTS[0], params)
        first = await stream.__anext__()
        await wait_for(lambda: not llm.engine.has_unfinished_requests())  # all 12 tokens made meanwhile
        await asyncio.sleep(0.05)
        return [first] + [o async for o in stream]

    outs = run_wrapped(llm, body)
    assert len(outs) == 2 and len(outs[0].outputs[0].token_ids) < 12  # the missed outputs merged into the last
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12


@pytest.mark.model
def test_leaving_a_stream_aborts_it(llm):
    async def body(aengine):
        async def breaker():
            n = 0
            async for _ in aengine.generate(PROMPTS[1], LONG, "breaker"):
                n += 1
                if n == 2:
                    break
            return n

        async def cancelled():
            async def consume():
                async for _ in aengine.generate(PROMPTS[2], LONG, "cancelled"):
                    got_one.set()

            got_one = asyncio.Event()
            task = asyncio.create_task(consume())
            await got_one.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        others = asyncio.gather(*(collect(aengine, p, GREEDY8) for p in PROMPTS[3:6]))
        n, _, other_outs = await asyncio.gather(breaker(), cancelled(), others)
        assert n == 2
        # The 200-token requests were left after a few tokens: gone by the time 8-token ones end.
        assert not {"breaker", "cancelled"} & set(llm.engine.requests)
        await wait_for(lambda: llm.engine.kv_manager.num_used == 0, timeout=2)
        assert not llm.engine.has_unfinished_requests() and aengine.num_in_flight == 0
        return other_outs

    alone = [llm.generate([p], GREEDY8, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[3:6]]
    other_outs = run_wrapped(llm, body)
    assert [o[-1].outputs[0].token_ids for o in other_outs] == alone


@pytest.mark.model
def test_bad_request_fails_alone(llm):
    async def body(aengine):
        async def bad(prompt, params=GREEDY8, rid=None):
            with pytest.raises(InvalidRequestError):
                await collect(aengine, prompt, params, rid)

        good = asyncio.create_task(collect(aengine, PROMPTS[0], GREEDY8, "good"))
        await asyncio.gather(bad({"prompt_token_ids": []}), bad([10**9]), bad("x " * 9000), bad(PROMPTS[0], rid="good"))
        return await good

    outs = run_wrapped(llm, body)
    assert outs[-1].finished and outs[-1].outputs[0].token_ids


@pytest.mark.model
def test_external_abort_ends_the_stream(llm):
    async def body(aengine):
        stream = aengine.generate(PROMPTS[0], LONG, "victim")
        first = await stream.__anext__()
        await aengine.abort("victim")
        rest = [o async for o in stream]
        return first, rest

    first, rest = run_wrapped(llm, body)
    assert not first.finished
    assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < 200


@pytest.mark.model
def test_step_error_fails_in_flight_and_loop_survives(llm):
    real_step = llm.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    async def body(aengine):
        results = await asyncio.gather(*(collect(aengine, p, LONG) for p in PROMPTS[:2]), return_exceptions=True)
        assert all(isinstance(r, EngineStepError) and isinstance(r.__cause__, RuntimeError) for r in results)
        assert llm.engine.kv_manager.num_used == 0 and aengine.is_running
        return await collect(aengine, PROMPTS[0], GREEDY8)

    llm.engine.step = flaky_step
    try:
        outs = run_wrapped(llm, body)
    finally:
        del llm.engine.step
    assert outs[-1].finished


@pytest.mark.model
def test_shutdown_with_requests_in_flight_is_prompt(llm):
    async def body(aengine):
        streams = [aengine.generate(p, LONG) for p in PROMPTS[:3]]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams))
        assert not any(f.finished for f in firsts)
        t0 = time.perf_counter()
        await aengine.shutdown()
        elapsed = time.perf_counter() - t0
        finals = [[o async for o in s][-1] for s in streams]
        with pytest.raises(EngineDeadError):
            await collect(aengine, PROMPTS[0], GREEDY8)
        return elapsed, finals

    elapsed, finals = run_wrapped(llm, body)
    assert elapsed < 5
    assert all(f.finished and f.outputs[0].finish_reason == "abort" for f in finals)


@pytest.mark.model
def test_drain_shutdown_finishes_in_flight(llm):
    async def body(aengine):
        async with aengine:
            stream = aengine.generate(PROMPTS[0], GREEDY8)
            first = await stream.__anext__()
            await aengine.shutdown(drain=True)
        return [first] + [o async for o in stream]

    outs = run_wrapped(llm, body)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason in ("stop", "length")


@pytest.mark.model
def test_idle_worker_does_not_spin(llm):
    async def body(aengine):
        await collect(aengine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=2))
        await asyncio.sleep(0.1)
        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(0.5)
        return (time.process_time() - cpu0) / (time.perf_counter() - t0)

    assert run_wrapped(llm, body) < 0.1  # fraction of one core used while idle


# ------------------------------------------------------------------ DeltaTracker (no model)
def _out(text, ids, finish=None, stop_reason=None):
    c = CompletionOutput(0, text, list(ids), finish_reason=finish, stop_reason=stop_reason)
    return RequestOutput("r", "p", [1], [c], finished=finish is not None)


def test_delta_tracker_holds_back_stop_string_prefixes():
    # The engine's cumulative text shows the start of a stop string before it is complete;
    # the final text is cut where the stop string begins.
    steps = [_out("Hello", [1]), _out("Hello wor", [1, 2]), _out("Hello world\n", [1, 2, 3]),
             _out("Hello world\n#", [1, 2, 3, 4]), _out("Hello world", [1, 2, 3, 4, 5], "stop", "\n##")]
    tracker = DeltaTracker(stop=["\n##", "zzz"])
    deltas = [tracker.update(o) for o in steps]
    texts = ["".join(d.text for d in ds) for ds in deltas]
    assert texts == ["Hello", " wor", "ld", "", ""]
    assert "".join(texts) == steps[-1].outputs[0].text
    assert [i for ds in deltas for d in ds for i in d.token_ids] == [1, 2, 3, 4, 5]
    assert deltas[-1][0].finish_reason == "stop" and deltas[-1][0].finished
    assert tracker.update(steps[-1]) == []  # nothing after the end


def test_delta_tracker_releases_a_false_alarm_and_n_outputs():
    tracker = DeltaTracker(stop="END")
    assert [d.text for d in tracker.update(_out("the E", [1]))] == ["the "]
    assert [d.text for d in tracker.update(_out("the Eagle", [1, 2]))] == ["Eagle"]
    out = RequestOutput("r", "p", [1], [CompletionOutput(0, "a", [5]), CompletionOutput(1, "b", [6])])
    t2 = DeltaTracker()
    assert [(d.index, d.text, d.token_ids) for d in t2.update(out)] == [(0, "a", [5]), (1, "b", [6])]
    assert t2.update(out) == []  # unchanged: no deltas
