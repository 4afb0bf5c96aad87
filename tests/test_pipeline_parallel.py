"""Pipeline parallelism (issue 32, item 2): the layers cut into stages, each a worker process (or a
tensor-parallel group of them) with its layers' weights and KV cache, hidden states sent between the
stages per micro-batch; the same greedy tokens as one process."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from conftest import catalog_model_path, check_equal, greedy_tokens, step_after_signal
from quant_tiny import build_tiny
from turbollm import LLM
from turbollm.config import ModelConfig
from turbollm.distributed.pipeline_parallel import partition_layers, split_microbatches
from turbollm.engine.llm_engine import LLMEngine
from turbollm.engine_args import EngineArgs
from turbollm.errors import InvalidRequestError

pytestmark = pytest.mark.slow  # process groups: the full tier (`make test`), not `make test-fast`


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp")
    return {arch: build_tiny(arch, folder / arch) for arch in ("llama", "qwen2", "gemma3")}


PROMPTS = [{"prompt_token_ids": [int(t) for t in torch.randint(4, 300, (n,), generator=torch.Generator()
                                                                  .manual_seed(n))]} for n in (5, 40, 90, 100)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_two_stages_equal_one_process(tiny, arch):
    """Two stages, two steps in flight, four sequences: the same greedy tokens as one process through the
    fused step (and, for llama, through the modules); each stage holds its layers only, and sends and receives per
    micro-batch."""
    one = LLM(str(tiny[arch]), threads=2)
    ref = greedy_tokens(one, PROMPTS)
    whole = one.engine.executor.footprint.weight_bytes
    layers = one.engine.config.num_layers
    del one
    for eager in (False, True) if arch == "llama" else (False,):  # the module path once: it is the same code
        llm = LLM(str(tiny[arch]), pipeline_parallel_size=2, threads=2, enforce_eager=eager)
        try:
            in_flight = _count_in_flight(llm.engine)
            check_equal(ref, greedy_tokens(llm, PROMPTS), 1e-4)
            assert max(in_flight) == 2  # stage 0 took a step while stage 1 ran the one before
            counts = llm.engine.args.pp_layer_partition
            assert len(counts) == 2 and sum(counts) == layers
            steps = llm.engine.executor.call("fused_steps")
            assert all(s > 10 for s in steps) if not eager else steps == [0, 0]
            per_rank = [f.weight_bytes for f in llm.engine.executor.call("footprint")]
            assert all(b < 0.85 * whole for b in per_rank), (per_rank, whole)
            assert sum(per_rank) < 1.02 * whole, (per_rank, whole)  # a tied table too is held once
            stats = llm.engine.executor.call("comm_stats")
            # a step takes half the sequences: the prompts of 5 + 40 tokens (one micro-batch), those of 90 + 100
            # (two), then 2 x 15 decode steps of two rows (whole); a tied table's rows come from the last stage
            tied = llm.engine.config.tie_word_embeddings
            assert tied == (arch != "qwen2")
            assert stats[0]["sends"] == 3 + 30 and stats[0]["recvs"] == (3 + 30 if tied else 0)
            assert stats[1]["recvs"] == stats[0]["sends"] and stats[1]["sends"] == stats[0]["recvs"]
        finally:
            llm.engine.shutdown()


def _count_in_flight(engine) -> list[int]:
    """The steps in flight each time the engine hands one out (a list that fills as it runs)."""
    seen, submit = [], engine.executor.submit

    def counting(sched):
        submit(sched)
        seen.append(len(engine._in_flight) + 1)

    engine.executor.submit = counting
    return seen


def test_int8_kv_in_two_stages(tiny):
    """int8 K/V with its float16 rings of recent tokens, each stage holding its layers' pool and rings: the
    one process's tokens."""
    ref = greedy_tokens(LLM(str(tiny["qwen2"]), threads=2, kv_cache_dtype="int8"), PROMPTS)
    llm = LLM(str(tiny["qwen2"]), threads=2, kv_cache_dtype="int8", pipeline_parallel_size=2)
    try:
        check_equal(ref, greedy_tokens(llm, PROMPTS), 1e-4)
        assert all(s > 10 for s in llm.engine.executor.call("fused_steps"))
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # untied head; tied (the last pair's vocabulary halves)
def test_tensor_and_pipeline_parallel_together(tiny, arch):
    """TP 2 x PP 2: four processes, each with a quarter of the layers' matrices; the same greedy tokens."""
    ref = greedy_tokens(LLM(str(tiny[arch]), threads=2), PROMPTS)
    llm = LLM(str(tiny[arch]), tensor_parallel_size=2, pipeline_parallel_size=2, threads=2)
    try:
        check_equal(ref, greedy_tokens(llm, PROMPTS), 1e-4)
        assert all(s > 10 for s in llm.engine.executor.call("fused_steps"))
        stats = llm.engine.executor.call("comm_stats")
        assert all(s["calls"] > 0 for s in stats)  # every stage all-reduces within its pair
        assert stats[0]["sends"] == stats[2]["recvs"] > 0 and stats[1]["sends"] == stats[3]["recvs"] > 0
        assert stats[2]["sends"] == stats[0]["recvs"] == (stats[0]["sends"] if arch == "llama" else 0)
    finally:
        llm.engine.shutdown()


@pytest.mark.model
def test_gguf_model_in_two_stages():
    """smollm2-135m (Q4_1 blocks, tied embedding): two stages give the one process's greedy tokens; the
    last stage alone holds the tied table (its LM head and the lookups it sends the first stage)."""
    path = str(catalog_model_path("smollm2-135m"))
    prompts = ["def fibonacci(n):", "The capital of France is", "Once upon a time"]
    one = LLM(path, threads=2)
    ref, whole = greedy_tokens(one, prompts), one.engine.executor.footprint.weight_bytes
    del one
    llm = LLM(path, pipeline_parallel_size=2, threads=2)
    try:
        check_equal(ref, greedy_tokens(llm, prompts), 2e-3)
        per_rank = [f.weight_bytes for f in llm.engine.executor.call("footprint")]
        assert sum(per_rank) < 1.01 * whole, (per_rank, whole)  # the 28 M-entry table once, not on both stages
    finally:
        llm.engine.shutdown()


def _config(**kw) -> ModelConfig:
    base = dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=32768, tie_word_embeddings=True)
    return ModelConfig(**(base | kw))


def test_partition_balances_parameters_with_the_lm_head_on_the_last_stage():
    """qwen2.5-0.5b's LM head (136 M parameters) weighs about nine of its 14.9 M-parameter layers: the last
    stage takes 7 of 24. A model without a large head splits evenly; a given partition is checked."""
    assert [len(r) for r in partition_layers(_config(), 2)] == [17, 7]
    assert [len(r) for r in partition_layers(_config(vocab_size=64), 2)] == [12, 12]
    assert [len(r) for r in partition_layers(_config(vocab_size=64), 3)] == [8, 8, 8]
    assert [(r.start, r.stop) for r in partition_layers(_config(), 2, [10, 14])] == [(0, 10), (10, 24)]
    for bad in ([10, 10], [24, 0], [24]):
        with pytest.raises(InvalidRequestError, match="pp_layer_partition"):
            partition_layers(_config(), 2, bad)


def test_each_stage_reads_its_own_tensors():
    """The loader's filter: a stage reads its layers; the first the embedding (untied), the last the norm and the
    head, and a tied table; a layer past the model's goes to the last stage (which refuses it as one process would)."""
    from turbollm.distributed import ParallelState

    first = ParallelState(pp_size=2, pp_rank=0, layer_start=0, layer_end=12)
    last = ParallelState(pp_size=2, pp_rank=1, layer_start=12, layer_end=24)
    name = "model.layers.{}.mlp.down_proj.weight".format
    assert first.holds_weight(name(11), False) and not first.holds_weight(name(12), False)
    assert last.holds_weight(name(12), False) and last.holds_weight(name(30), False)
    assert not first.holds_weight(name(30), False)
    for tied in (False, True):
        assert first.holds_weight("model.embed_tokens.weight", tied) is not tied
        assert last.holds_weight("model.embed_tokens.weight", tied) is tied
        assert last.holds_weight("model.norm.weight", tied) and not first.holds_weight("lm_head.weight", tied)


def test_microbatches_cut_sequences_by_tokens():
    assert split_microbatches([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert split_microbatches([100, 1, 1], 2) == [range(0, 1), range(1, 3)]
    assert split_microbatches([1, 100], 3) == [range(0, 1), range(1, 2)]
    assert split_microbatches([7], 4) == [range(0, 1)]
    assert split_microbatches([1, 1, 1, 1], 2, min_tokens=64) == [range(0, 4)]  # a decode step: whole
    assert split_microbatches([100, 30, 2], 3, min_tokens=64) == [range(0, 1), range(1, 3)]


@pytest.mark.parametrize("kw, message", [
    (dict(pipeline_parallel_size=9), "more stages than the model's 2 layers"),  # the tiny models: 2 layers
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be >= 1"),
    (dict(pipeline_parallel_size=2, pp_layer_partition="2,1"), "pp_layer_partition 2,1"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "does not take speculative decoding"),
    (dict(pipeline_parallel_size=2, kv_policy="h2o", kv_budget=64), "does not take pipeline parallelism"),
])
def test_impossible_pipelines_are_refused_before_any_rank_starts(tiny, kw, message, monkeypatch):
    import turbollm.executor.multiproc as multiproc

    monkeypatch.setattr(multiproc.MultiprocExecutor, "__init__", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(InvalidRequestError, match=message):
        LLM(str(tiny["llama"]), **kw)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_hung_stage_is_named_within_ten_seconds(tiny, rank):
    """A stage stopped (SIGSTOP): the other sleeps in its receive (stage 0 stopped) or in its send (stage 1
    stopped), no rank uses CPU, and the engine names the stopped worker as hung within 10 s."""
    engine = LLMEngine(EngineArgs(model=str(tiny["llama"]), threads=2, pipeline_parallel_size=2))
    pid = engine.executor._procs[rank].pid
    try:
        step_after_signal(engine, rank, signal.SIGSTOP, rf"worker {rank} \(pid \d+\) stopped answering \(hung\)")
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.shutdown()
