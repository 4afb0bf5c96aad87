"""Tensor parallelism on torch.distributed (issue 32, item 1): N worker processes joined over gloo, each
with its shard of the weights and KV heads; the same greedy tokens as one process."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from conftest import catalog_model_path, check_equal, greedy_tokens, step_after_signal
from quant_tiny import build_tiny
from turbollm import LLM
from turbollm.engine.llm_engine import LLMEngine
from turbollm.engine_args import EngineArgs
from turbollm.errors import InvalidRequestError
from turbollm.executor.base import ExecutorError, WorkerDiedError
from turbollm.handoff.scheduler_output import SchedulerOutput

pytestmark = pytest.mark.slow  # process groups: the full tier (`make test`), not `make test-fast`


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    return {arch: build_tiny(arch, folder / arch) for arch in ("llama", "qwen2", "gemma3")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_two_ranks_equal_one(tiny, arch):
    """GQA (llama), biases and an untied head (qwen2), MQA with its one KV head kept by both ranks and
    sliding layers (gemma3): the same greedy tokens as one process, through the fused step on every rank
    and through the modules; each rank holds about half the weights."""
    prompts = [{"prompt_token_ids": [int(t) for t in torch.randint(4, 300, (n,), generator=torch.Generator()
                                                                      .manual_seed(n))]} for n in (5, 40, 90)]
    one = LLM(str(tiny[arch]), threads=2)
    ref = greedy_tokens(one, prompts)
    whole = one.engine.executor.footprint.weight_bytes
    del one
    for eager in (False, True):
        llm = LLM(str(tiny[arch]), tensor_parallel_size=2, threads=2, enforce_eager=eager)
        try:
            check_equal(ref, greedy_tokens(llm, prompts), 1e-4)
            steps = llm.engine.executor.call("fused_steps")
            assert all(s > 10 for s in steps) if not eager else steps == [0, 0]
            per_rank = [f.weight_bytes for f in llm.engine.executor.call("footprint")]
            # every matrix and the vocabulary split in two; norms (and gemma3's single KV head) kept whole
            assert all(0.5 * whole <= b < 0.62 * whole for b in per_rank), (per_rank, whole)
        finally:
            llm.engine.shutdown()


@pytest.mark.model
def test_gguf_model_split_in_three():
    """smollm2-135m (Q4_1 blocks of 32, 9 heads and 3 KV heads, vocabulary 49152) on 3 ranks: the same greedy
    tokens as one process."""
    path = str(catalog_model_path("smollm2-135m"))
    prompts = ["def fibonacci(n):", "The capital of France is", "Once upon a time"]
    ref = greedy_tokens(LLM(path, threads=2), prompts)
    llm = LLM(path, tensor_parallel_size=3, threads=2)
    try:
        check_equal(ref, greedy_tokens(llm, prompts), 5e-3)  # the q8 activations of each shard round apart
        assert all(s > 10 for s in llm.engine.executor.call("fused_steps"))
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("size, message", [
    (3, "does not divide its 4 attention heads"),  # the tiny llama: 4 heads, 2 KV heads
    (0, "tensor_parallel_size must be >= 1"),
])
def test_impossible_splits_are_refused_before_any_rank_starts(tiny, size, message, monkeypatch):
    import turbollm.executor.multiproc as multiproc

    monkeypatch.setattr(multiproc.MultiprocExecutor, "__init__", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(InvalidRequestError, match=message):
        LLM(str(tiny["llama"]), tensor_parallel_size=size)


@pytest.mark.parametrize("parallel, rank", [(dict(tensor_parallel_size=2), 1), (dict(pipeline_parallel_size=2), 0)])
def test_a_dead_rank_is_named_within_seconds(tiny, parallel, rank):
    """A rank killed (the other waits in its all-reduce, or for the first stage's hidden states): the engine
    names it within 10 s."""
    engine = LLMEngine(EngineArgs(model=str(tiny["llama"]), threads=2, **parallel))
    try:
        step_after_signal(engine, rank, signal.SIGKILL, rf"worker {rank} \(pid \d+\) was killed by signal 9 while")
    finally:
        engine.shutdown()


def test_a_hung_rank_is_named_within_ten_seconds(tiny):
    """Rank 1 stopped (SIGSTOP): rank 0's all-reduce times out, and the engine names rank 1 as hung."""
    from turbollm.distributed.tensor_parallel import STEP_TIMEOUT_S
    from turbollm.executor.multiproc import HANG_GRACE_S

    assert STEP_TIMEOUT_S + HANG_GRACE_S < 10
    engine = LLMEngine(EngineArgs(model=str(tiny["llama"]), threads=2, tensor_parallel_size=2))
    pid = engine.executor._procs[1].pid
    try:
        step_after_signal(engine, 1, signal.SIGSTOP, r"worker 1 \(pid \d+\) stopped answering \(hung\)")
        os.kill(pid, signal.SIGCONT)  # back, but its collectives are out of step with rank 0's: no more steps
        with pytest.raises(WorkerDiedError, match="out of step"):
            engine.executor.execute_model(SchedulerOutput())
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.shutdown()


def test_a_rank_that_cannot_start_says_why(tiny):
    """int4-g64's groups do not divide a rank's 32 o_proj inputs (64 in one process): the engine reports the
    rank's own error, promptly, not a hang while the other ranks wait for it to join."""
    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match=r"worker \d failed to start(.|\n)*group size 64 does not divide a "
                                            r"layer's 32 input features"):
        LLMEngine(EngineArgs(model=str(tiny["llama"]), threads=2, tensor_parallel_size=2, quantization="int4-g64"))
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_server_answers_a_clean_error_when_a_rank_dies_mid_request(tiny, parallel):
    """`turbollm serve` with 2 ranks (tensor-parallel, or two pipeline stages): rank 1 killed at the 6th step
    of a streamed request; the stream ends with an error naming it within 10 s, /health says 503, and a new
    request is refused with 503."""
    import asyncio

    import httpx
    from turbollm.entrypoints.async_engine import AsyncLLMEngine
    from turbollm.server.app import ServerSettings, build_app

    engine = LLMEngine(EngineArgs(model=str(tiny["llama"]), threads=2, **parallel))
    steps, t_kill = [0], [0.0]
    collect = engine.executor.collect

    def killing_collect():
        steps[0] += 1
        if steps[0] == 6:  # mid-request: the prompt is done and tokens are streaming
            os.kill(engine.executor._procs[1].pid, signal.SIGKILL)
            t_kill[0] = time.monotonic()
        return collect()

    engine.executor.collect = killing_collect
    aengine = AsyncLLMEngine(engine)
    app = build_app(aengine, ServerSettings(served_model_names=["tiny"]))

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
            assert (await client.get("/health")).status_code == 200
            body = {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 200, "ignore_eos": True, "stream": True}
            resp = await client.post("/v1/completions", json=body)
            ended = time.monotonic()
            health = (await client.get("/health")).status_code
            again = await client.post("/v1/completions", json={**body, "stream": False})
            return resp.text, ended, health, again

    try:
        text, ended, health, again = asyncio.run(go())
    finally:
        aengine.shutdown_sync(timeout=5)
        engine.shutdown()
    assert steps[0] >= 6 and ended - t_kill[0] < 10
    assert '"text"' in text and "worker 1" in text and "error" in text, text[-500:]
    assert health == 503 and again.status_code == 503


def test_shards_split_on_block_boundaries():
    """The MLP width of qwen2.5-coder-0.5b (4864) over 2 ranks on Q6_K's 256-weight blocks: 10 blocks and 9,
    no rank cutting a block; an even split where the blocks allow it; every unit assigned once."""
    from turbollm.distributed import ParallelState

    assert [ParallelState(2, r).shard(4864, 256) for r in range(2)] == [(0, 2560), (2560, 2304)]
    assert [ParallelState(2, r).shard(128) for r in range(2)] == [(0, 64), (64, 64)]
    parts = [ParallelState(3, r).shard(8960, 256) for r in range(3)]
    assert parts[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(parts, parts[1:]))
    assert sum(n for _, n in parts) == 8960 and all(n % 256 == 0 for _, n in parts)
    with pytest.raises(ValueError):
        ParallelState(2, 0).shard(100, 32)


def test_gptq_act_order_folder_is_refused_with_its_reason(tiny, tmp_path):
    """An act-order permutation spans every input column: no rank can hold a slice of it. The ranks say so at
    start-up (before: a shape mismatch deep in the loader)."""
    from quant_tiny import calibration_text
    from turbollm.quantize.methods import QuantizeOptions
    from turbollm.quantize.runner import run_quantize

    out = tmp_path / "gptq"
    run_quantize(QuantizeOptions(str(tiny["qwen2"]), "gptq", out, group_size=32, act_order=True, calib_samples=8,
                                 calib_seq_len=64, calib_data=str(calibration_text(tmp_path / "calib.txt")),
                                 progress=False), log=lambda s: None)
    with pytest.raises(ExecutorError, match="failed to start(.|\n)*cannot split a GPTQ act-order checkpoint"):
        LLMEngine(EngineArgs(model=str(out), threads=2, tensor_parallel_size=2))
