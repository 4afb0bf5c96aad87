"""Executors: the worker in this process ("uni") and in a worker process ("mp") give the same outputs,
token for token, through greedy and seeded sampling, n = 2, prefix-cache hits and preemption; a worker
that fails a step or dies is reported, naming it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import catalog_model_path, step_after_signal
from quant_tiny import build_tiny
from turbollm import SamplingParams
from turbollm.engine.llm_engine import LLMEngine
from turbollm.engine_args import EngineArgs
from turbollm.executor.base import ExecutorError
from turbollm.handoff.scheduler_output import SchedulerOutput

pytestmark = pytest.mark.slow  # worker processes: the full tier (`make test`), not `make test-fast`

pytest.importorskip("transformers")

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # the tiny llama: K and V, 2 layers, 2 KV heads, head dim 16, float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny("llama", tmp_path_factory.mktemp("tiny-llama-exec")))


def workload(vocab_words: int = 300) -> list[tuple[list[int], SamplingParams]]:
    """16 requests: greedy and seeded, n = 2 on some, a shared 32-token prefix on half (prefix-cache hits),
    logprobs and prompt logprobs on a few."""
    shared = [4 + (5 * i) % vocab_words for i in range(32)]
    reqs = []
    for i in range(16):
        own = [4 + (11 * i + 3 * j) % vocab_words for j in range(6 + i % 5)]
        prompt = (shared + own) if i % 2 else own + shared[:5]
        if i % 4 == 0:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        elif i % 4 == 1:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12, ignore_eos=True, n=2)
        elif i % 4 == 2:
            params = SamplingParams(temperature=0.7, top_k=20, seed=200 + i, max_tokens=10, ignore_eos=True,
                                    repetition_penalty=1.2, prompt_logprobs=1)
        else:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
        reqs.append((prompt, params))
    return reqs


def run(engine: LLMEngine, reqs) -> dict:
    for i, (prompt, params) in enumerate(reqs):
        engine.add_request({"prompt_token_ids": prompt}, params, f"r{i}")
    done = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests() and len(done) == len(reqs)
    return {rid: ([(c.token_ids, c.text, c.finish_reason,
                    [sorted((t, round(lp.logprob, 5)) for t, lp in pos.items()) for pos in (c.logprobs or [])])
                   for c in o.outputs],
                  None if o.prompt_logprobs is None else
                  [None if p is None else sorted((t, round(lp.logprob, 5)) for t, lp in p.items())
                   for p in o.prompt_logprobs])
            for rid, o in done.items()}


def both(model: str, **kw) -> tuple[dict, dict, dict]:
    results, stats = {}, {}
    for backend in ("uni", "mp"):
        engine = LLMEngine(EngineArgs(model=model, threads=1, distributed_executor_backend=backend, **kw))
        try:
            results[backend] = run(engine, workload())
            stats[backend] = engine.stats()
        finally:
            engine.shutdown()
    return results["uni"], results["mp"], stats


def test_mp_equals_uni_with_preemption_and_prefix_hits(tiny):
    """A pool of 12 blocks of 16 tokens for 16 requests of ~60 tokens (n = 2 on 8 of them): preemption is
    certain; a shared prefix gives prefix-cache hits."""
    uni, mp, stats = both(tiny, kv_cache_memory=192 * BYTES_PER_TOKEN, max_num_seqs=8)
    assert uni == mp
    for s in stats.values():
        assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0
    assert stats["uni"] == stats["mp"]
    for i in range(16):
        assert len(uni[f"r{i}"][0]) == (2 if i % 4 in (1, 3) else 1)


@pytest.mark.model
def test_mp_equals_uni_on_smollm2():
    """The same 16-request workload on a catalog model in its GGUF default (Q4_1 weights, fp16 K/V) with room
    for everything: the plain-data hand-off loses nothing on a real model either."""
    uni, mp, stats = both(str(catalog_model_path("smollm2-135m")), kv_cache_memory=16 << 20)
    assert uni == mp and stats["uni"]["prefix_cache_hits"] > 0


def test_a_worker_that_fails_a_step_is_reported_and_keeps_serving(tiny):
    engine = LLMEngine(EngineArgs(model=tiny, threads=1, distributed_executor_backend="mp"))
    try:
        bogus = SchedulerOutput(scheduled_token_ids={12345: [5]})  # a sequence the worker never heard of
        with pytest.raises(ExecutorError, match="worker 0 failed a step(.|\n)*KeyError"):
            engine.executor.execute_model(bogus)
        engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True), "after")
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert len(outs[-1].outputs[0].token_ids) == 3
    finally:
        engine.shutdown()


def test_a_dead_worker_is_named_within_seconds(tiny):
    engine = LLMEngine(EngineArgs(model=tiny, threads=1, distributed_executor_backend="mp"))
    try:
        step_after_signal(engine, 0, signal.SIGKILL, r"worker 0 \(pid \d+\) was killed by signal 9 while")
    finally:
        engine.shutdown()


def test_a_worker_that_cannot_start_says_why(tiny, tmp_path):
    from turbollm.executor.multiproc import MultiprocExecutor

    engine = LLMEngine(EngineArgs(model=tiny, threads=1, distributed_executor_backend="mp"))
    engine.shutdown()
    with pytest.raises(ExecutorError, match="worker 0 failed to start(.|\n)*no-such-model"):
        MultiprocExecutor(EngineArgs(model=str(tmp_path / "no-such-model")).engine_config(), engine.kv_config)


def _generate(engine: LLMEngine, n: int = 3) -> list[int]:
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0),
                       f"g{time.time()}")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[-1].outputs[0].token_ids


def test_ctrl_c_in_the_terminal_does_not_kill_the_worker(tiny):
    """Before: SIGINT (Ctrl-C reaches the whole process group) killed the worker process."""
    engine = LLMEngine(EngineArgs(model=tiny, threads=1, distributed_executor_backend="mp"))
    try:
        os.kill(engine.executor._procs[0].pid, signal.SIGINT)
        time.sleep(0.5)
        assert engine.executor._procs[0].is_alive() and len(_generate(engine)) == 3
    finally:
        engine.shutdown()


def test_a_reply_the_engine_stopped_waiting_for_is_dropped(tiny):
    """Before: a step interrupted while waiting (Ctrl-C in a notebook) left its reply in the pipe, and every
    later step read the reply of the step before it."""
    engine = LLMEngine(EngineArgs(model=tiny, threads=1, distributed_executor_backend="mp"))
    try:
        ex = engine.executor
        ex._step += 1
        ex._conns[0].send(("execute", ex._step, SchedulerOutput()))  # sent, its reply never read
        want = LLMEngine(EngineArgs(model=tiny, threads=1))
        assert _generate(engine, 5) == _generate(want, 5)
    finally:
        engine.shutdown()


def test_a_dead_worker_stops_the_async_engine(tiny):
    """Before: every request failed with EngineStepError while the async engine (and /health) said running."""
    import asyncio

    from turbollm.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError

    engine = LLMEngine(EngineArgs(model=tiny, threads=1, distributed_executor_backend="mp"))
    aengine = AsyncLLMEngine(engine)

    async def go():
        os.kill(engine.executor._procs[0].pid, signal.SIGKILL)
        with pytest.raises((EngineStepError, EngineDeadError), match="worker 0"):
            async for _ in aengine.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3)):
                pass
        for _ in range(100):
            if not aengine.is_running:
                break
            await asyncio.sleep(0.05)
        assert not aengine.is_running

    try:
        asyncio.run(go())
    finally:
        aengine.shutdown_sync(timeout=5)
        engine.shutdown()
