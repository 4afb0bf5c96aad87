"""Prefill/decode hand-off through the p2p KV connector (handoff/kv_transfer.py, core/ and worker/ kv_connector.py,
core/scheduler_kv_transfer.py): a producer engine prefills and samples the first token, a consumer engine loads the
prompt's K/V from the producer's pool and decodes on — the tokens and logprobs equal, bit for bit, one engine's
doing it all. A hand-off that is missing, late, corrupt, or of another dtype or prompt makes the consumer prefill
itself, with the same output; the producer holds the blocks until they are taken or expire. Tiny random models: no catalog model needed.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from quant_tiny import build_tiny
from turbollm.errors import InvalidRequestError

PROMPTS = [[(7 * i + j) % 200 + 5 for j in range(100 + 37 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {arch: str(build_tiny(arch, tmp_path_factory.mktemp(arch))) for arch in ("llama", "gemma3")}


def _params(max_tokens: int, **kw):
    from turbollm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, **kw)


def _result(o):
    return o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs], o.outputs[0].finish_reason


def _engine(model: str, role: str | None, buf: Path, timeout: float = 30.0, **kw):
    from turbollm import LLM

    if role is not None:
        kw["kv_transfer_config"] = {"kv_connector": "p2p", "kv_role": role, "kv_buffer_path": str(buf),
                                    "kv_timeout": timeout}
    return LLM(model, kv_cache_memory=1 << 24, threads=2, **kw)


@contextmanager
def _pair(model: str, buf: Path, consumer_timeout: float = 30.0, **kw):
    """A producer and a consumer engine on one buffer folder, shut down after."""
    producer = _engine(model, "kv_producer", buf, **kw)
    consumer = _engine(model, "kv_consumer", buf, timeout=consumer_timeout, **kw)
    try:
        yield producer, consumer
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()


def _single(model: str, prompts, n: int = 6, **kw):
    llm = _engine(model, None, Path("."), **kw)
    try:
        return [_result(o) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], _params(n),
                                                 use_tqdm=False)]
    finally:
        llm.engine.shutdown()


def _prefill(producer, prompts):
    outs = producer.generate([{"prompt_token_ids": p} for p in prompts],
                             _params(1, kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)
    return [o.kv_transfer_params for o in outs]


def _decode(consumer, prompts, handoffs, n: int = 6):
    outs = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                             [_params(n, kv_transfer_params=h) for h in handoffs], use_tqdm=False)
    return [_result(o) for o in outs]


@pytest.mark.parametrize("arch,kv", [("llama", "float32"), ("llama", "auto"), ("gemma3", "float16"), ("llama", "int8"),
                                     ("gemma3", "int4")])
def test_prefill_here_decode_there_equals_one_engine(tiny, tmp_path, arch, kv):
    model = tiny[arch]
    kw = {"kv_cache_dtype": kv, **({"kv_recent_window": 40} if kv in ("int8", "int4") else {})}
    want = _single(model, PROMPTS, **kw)
    with _pair(model, tmp_path, **kw) as (producer, consumer):
        handoffs = _prefill(producer, PROMPTS)
        assert all(h["do_remote_prefill"] and h["remote_num_tokens"] == len(p) and h["first_token"]["rank"] >= 1
                   for h, p in zip(handoffs, PROMPTS))
        assert _decode(consumer, PROMPTS, handoffs) == want
        s = consumer.engine.stats()
        assert s["kv_bundles_received"] == len(PROMPTS) and s["kv_remote_fallbacks"] == 0
        assert s["prefix_cache_hits"] == 0  # a fresh consumer: every block from the bundles
        assert producer.engine.stats()["kv_bundles_sent"] == len(PROMPTS)
        assert not list(tmp_path.rglob("*.kvs")) and not list(tmp_path.rglob("*.tmp"))  # consumed
        # the loaded prompts entered the consumer's own prefix cache: the same prompts again take their start from
        # it and load only the rest (a quantized format indexes only blocks already quantized: 100-token prompts
        # hold too few to count on). Both sides now take prefix hits: tokens are compared, not the last bits.
        again = _decode(consumer, PROMPTS, _prefill(producer, PROMPTS))
        assert [g[0] for g in again] == [w[0] for w in want]
        s2 = consumer.engine.stats()
        if kv not in ("int8", "int4"):
            assert s2["prefix_cache_hits"] >= sum(len(p) // 16 * 16 - 16 for p in PROMPTS)
            assert s2["kv_blocks_loaded"] - s["kv_blocks_loaded"] < s["kv_blocks_loaded"] / 2


def test_a_missing_corrupt_or_foreign_bundle_is_prefilled_by_the_consumer(tiny, tmp_path):
    model = tiny["llama"]
    want = _single(model, PROMPTS)
    with _pair(model, tmp_path, consumer_timeout=0.3) as (producer, consumer):
        handoffs = _prefill(producer, PROMPTS)
        missing = dict(handoffs[0], remote_bundle=str(tmp_path / "never-written.kvs"))
        corrupt = Path(handoffs[1]["remote_bundle"])
        data = bytearray(corrupt.read_bytes())
        data[-20] ^= 0xFF
        corrupt.write_bytes(bytes(data))
        # prompt 2's bundle for a request with prompt 0's tokens (and prompt 0's first token)
        other_prompt = dict(handoffs[2], first_token=handoffs[0]["first_token"])
        t0 = time.monotonic()
        got = _decode(consumer, [PROMPTS[0], PROMPTS[1]], [missing, handoffs[1]])
        assert got == want[:2] and time.monotonic() - t0 >= 0.3
        got = _decode(consumer, [PROMPTS[0]], [dict(other_prompt, remote_num_tokens=len(PROMPTS[0]))])
        # (prompt 0's first token given, only the K/V of another prompt; prompt 0 is in this engine's prefix cache
        # by now, and a prefix hit rounds the last bits of the logprobs differently: the tokens are compared)
        assert got[0][0] == want[0][0]
        assert consumer.engine.stats()["kv_remote_fallbacks"] == 3
        # the bad hand-offs were taken and dropped; the one no consumer asked for waits for its deadline
        assert [str(p) for p in tmp_path.rglob("*.kvs")] == [handoffs[0]["remote_bundle"]]


def test_a_bundle_of_another_kv_dtype_is_refused(tiny, tmp_path):
    model = tiny["llama"]
    want = _single(model, PROMPTS[:1], kv_cache_dtype="float16")
    producer = _engine(model, "kv_producer", tmp_path, kv_cache_dtype="float32")
    consumer = _engine(model, "kv_consumer", tmp_path, kv_cache_dtype="float16")
    try:
        (got,) = _decode(consumer, PROMPTS[:1], _prefill(producer, PROMPTS[:1]))
        # (the first token and its logprob are the float32 producer's; every later one the consumer's own)
        assert got[0] == want[0][0] and got[1][1:] == want[0][1][1:]
        assert consumer.engine.stats()["kv_remote_fallbacks"] == 1
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()


def test_the_first_token_alone_can_finish_a_request_and_bad_ones_are_named(tiny, tmp_path):
    model = tiny["llama"]
    with _pair(model, tmp_path) as (producer, consumer):
        (h,) = _prefill(producer, PROMPTS[:1])
        (got,) = _decode(consumer, PROMPTS[:1], [h], n=1)
        assert got[0] == [h["first_token"]["id"]] and got[2] == "length"
        for bad, message in (({"id": "x"}, "first_token: expected"), ({"id": 10 ** 9}, "outside the vocabulary")):
            with pytest.raises(InvalidRequestError, match=message):
                consumer.engine.add_request({"prompt_token_ids": PROMPTS[0]},
                                            _params(3, kv_transfer_params=dict(h, first_token=bad)))
        with pytest.raises(InvalidRequestError, match="takes n = 1"):
            consumer.engine.add_request({"prompt_token_ids": PROMPTS[0]},
                                        _params(3, n=2, kv_transfer_params=h))


def test_an_aborted_consumer_request_frees_its_blocks_and_the_bundle(tiny, tmp_path):
    model = tiny["llama"]
    with _pair(model, tmp_path, consumer_timeout=5) as (producer, consumer):
        (h,) = _prefill(producer, PROMPTS[:1])
        late = dict(h, remote_bundle=str(Path(h["remote_bundle"]).with_name("late.kvs")))
        engine = consumer.engine
        engine.add_request({"prompt_token_ids": PROMPTS[0]}, _params(4, kv_transfer_params=late), request_id="r")
        engine.step()  # takes blocks and waits for the bundle
        assert engine.stats()["kv_blocks_used"] > 0
        engine.abort("r")
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.stats()["kv_blocks_used"] == 0


def test_the_producer_holds_the_blocks_until_taken_or_expired(tiny, tmp_path):
    model = tiny["llama"]
    with _pair(model, tmp_path) as (producer, consumer):
        engine = producer.engine
        (h,) = _prefill(producer, PROMPTS[:1])
        held = -(-len(PROMPTS[0]) // 16)
        assert engine.stats()["kv_blocks_held"] == held and engine.stats()["kv_blocks_used"] >= held
        _decode(consumer, PROMPTS[:1], [h])
        engine.step()  # (the next schedule frees what was taken)
        assert engine.stats()["kv_blocks_held"] == 0 and engine.stats()["kv_blocks_used"] == 0
    producer = _engine(model, "kv_producer", tmp_path, timeout=0.2)
    try:
        engine = producer.engine
        (h,) = _prefill(producer, PROMPTS[:1])
        assert Path(h["remote_bundle"]).is_file() and engine.stats()["kv_blocks_held"] == held
        time.sleep(0.3)
        engine.step()
        s = engine.stats()
        assert not list(tmp_path.rglob("*.kvs*")) and s["kv_blocks_held"] == 0 and s["kv_handoffs_expired"] == 1
        assert s["kv_blocks_used"] == 0
    finally:
        producer.engine.shutdown()


def test_an_idle_server_frees_the_blocks_taken(tiny, tmp_path):
    """With no request after the hand-off, the serving wrapper's idle worker still frees the blocks the consumer
    took (the held-blocks gauge does not stay up until the next request)."""
    from turbollm.entrypoints.async_engine import IDLE_POLL_S, AsyncLLMEngine

    with _pair(tiny["llama"], tmp_path) as (producer, consumer):
        (h,) = _prefill(producer, PROMPTS[:1])
        served = AsyncLLMEngine(producer.engine)
        try:
            assert producer.engine.stats()["kv_blocks_held"] > 0
            _decode(consumer, PROMPTS[:1], [h])
            deadline = time.monotonic() + 10 * IDLE_POLL_S
            while producer.engine.stats()["kv_blocks_held"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert producer.engine.stats()["kv_blocks_held"] == 0
        finally:
            served.shutdown_sync(timeout=30)


def test_a_claim_held_past_the_deadline_is_broken_and_the_copy_refused(tiny, tmp_path):
    """A consumer that claimed a hand-off and did not release it (died, or hung, mid-copy): past twice the timeout
    the producer deletes the claim and frees the blocks; a consumer that finishes after that refuses its copy."""
    from turbollm.kv_transfer.shared_pool import claim, finish

    producer = _engine(tiny["llama"], "kv_producer", tmp_path, timeout=0.6)
    try:
        engine = producer.engine
        (h,) = _prefill(producer, PROMPTS[:1])
        taking = claim(h["remote_bundle"])
        assert taking is not None and claim(h["remote_bundle"]) is None  # one claimer wins
        time.sleep(0.7)
        engine.step()
        assert engine.stats()["kv_blocks_held"] > 0  # claimed: kept past the deadline...
        time.sleep(0.6)
        engine.step()
        assert engine.stats()["kv_blocks_held"] == 0  # ...until twice the timeout
        assert finish(taking) is False  # the late consumer learns its copy may be stale
    finally:
        producer.engine.shutdown()


def test_the_block_copy_kernel_equals_the_reference():
    import torch

    from turbollm.kernels import build_error, get_kernels
    from turbollm.kv_transfer.block_copy import copy_blocks_reference

    k = get_kernels()
    assert k is not None, build_error()
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randint(0, 255, (40, n), dtype=torch.uint8, generator=g) for n in (4096, 64, 8192)]
    src_idx, dst_idx = torch.randperm(40, generator=g)[:23], torch.randperm(30, generator=g)[:23]
    want = [torch.randint(0, 255, (30, s.shape[1]), dtype=torch.uint8, generator=g) for s in srcs]
    got = [w.clone() for w in want]
    copy_blocks_reference(srcs, want, src_idx, dst_idx)
    k.copy_kv_blocks(srcs, got, src_idx, dst_idx)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(RuntimeError, match="outside part"):
        k.copy_kv_blocks(srcs, got, src_idx, dst_idx + 30)


def test_a_pool_is_opened_only_while_its_producer_lives(tmp_path):
    """Another process's pool is read through /proc/PID/fd only while that process lives and the file is the one
    named; once it is gone, its mapping is dropped (its memory not kept alive here) and it is refused."""
    import json
    import subprocess
    import sys

    import torch

    from turbollm.kv_transfer import shared_pool
    from turbollm.kv_transfer.shared_pool import PoolError, SharedArena, open_pool, part_view

    arena = SharedArena([100])
    with pytest.raises(PoolError, match="not the producer's pool"):
        open_pool({**arena.ref(), "ino": arena.ino + 1})
    producer = subprocess.Popen([sys.executable, "-c", (
        "import json, sys, torch\n"
        "from turbollm.kv_transfer.shared_pool import SharedArena\n"
        "a = SharedArena([8192])\nt = a.tensor((2, 4096), torch.uint8)\nt[1].fill_(7)\n"
        "print(json.dumps({**a.ref(), 'off': a.offset(t)}), flush=True)\nsys.stdin.read()\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ref = json.loads(producer.stdout.readline())
        pool = open_pool(ref).tensor
        assert int(part_view(pool, ref["off"], 2, 4096)[1].sum()) == 7 * 4096
        with pytest.raises(PoolError, match="outside"):
            part_view(pool, ref["off"], 3, 8192)
        assert any(k[0] == ref["pid"] for k in shared_pool._maps)
    finally:
        producer.kill()
        producer.wait()
    del pool
    with pytest.raises(PoolError, match="cannot be opened"):
        open_pool(ref)
    assert not any(k[0] == ref["pid"] for k in shared_pool._maps)


def test_p2p_refuses_an_unwritable_buffer(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    from turbollm import LLM

    with pytest.raises(InvalidRequestError, match="kv_buffer_path"):
        LLM("no-such-model", kv_transfer_config={"kv_connector": "p2p", "kv_role": "kv_producer",
                                                 "kv_buffer_path": str(blocker / "x")})


@pytest.mark.slow  # worker processes
def test_the_hand_off_between_worker_processes(tiny, tmp_path):
    model = tiny["llama"]
    want = _single(model, PROMPTS)
    with _pair(model, tmp_path, distributed_executor_backend="mp") as (producer, consumer):
        assert _decode(consumer, PROMPTS, _prefill(producer, PROMPTS)) == want
