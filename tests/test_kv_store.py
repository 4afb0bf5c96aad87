"""The KV connector's block store: prefix blocks in files that outlive the engine (handoff/kv_transfer.py,
kv_transfer/block_store.py, core/ and worker/ kv_connector.py).

A restarted engine naming the same folder loads a prompt's prefix instead of computing it and gives the
same tokens and logprobs as an engine that took the same prefix from its own cache; a block that is
corrupt, short or written for another key is refused and recomputed, with the output unchanged; a block
of another K/V dtype is never found; the folder stays under its size cap. Tiny random models: no catalog
model needed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from quant_tiny import build_tiny
from turbollm.errors import InvalidRequestError
from turbollm.handoff.kv_transfer import parse_kv_transfer_config
from turbollm.kv_transfer.block_store import BlockStore, BlockStoreError

LAYOUT = [[0, "k", "float16", [16, 2, 8]]]


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("value,message", [
    ('{"kv_connector": "stor", "kv_store_path": "/tmp/x"}', "unknown kv_connector 'stor' \\(did you mean 'store'"),
    ('{"kv_connector": "store", "kv_role": "both", "kv_store_path": "/tmp/x"}', "unknown kv_role 'both'"),
    ('{"kv_connector": "store", "kv_store_pth": "/tmp/x"}', "unknown field 'kv_store_pth' \\(did you mean"),
    ('{"kv_connector": "store"}', "needs 'kv_store_path'"),
    ('{"kv_connector": "store", "kv_store_path": "/tmp/x", "kv_store_max_bytes": -1}', "byte count"),
    ("{not json", "not valid JSON"),
])
def test_a_bad_transfer_config_is_named(value, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_kv_transfer_config(value)


def test_store_path_alone_means_the_store_in_both_roles():
    c = parse_kv_transfer_config(None, "/tmp/kvs")
    assert (c.kv_connector, c.kv_role, c.kv_store_path) == ("store", "kv_both", "/tmp/kvs") and c.saves and c.loads
    consumer = parse_kv_transfer_config({"kv_connector": "store", "kv_role": "kv_consumer", "kv_store_path": "/x"})
    assert (consumer.saves, consumer.loads) == (False, True)


def test_an_unwritable_store_path_fails_at_start(tmp_path):
    from turbollm import LLM

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InvalidRequestError, match="not a writable folder"):
        LLM("no-such-model", kv_store_path=str(blocker / "store"))  # (before the model is looked up)


# ---------------------------------------------------------------- the files
def test_a_block_round_trips_and_every_defect_is_refused(tmp_path):
    store = BlockStore(tmp_path, max_bytes=1 << 20)
    key, payload = bytes(range(24)), os.urandom(512)
    assert store.get(key, LAYOUT) is None and not store.contains(key)
    store.put(key, LAYOUT, payload)
    assert store.contains(key) and store.get(key, LAYOUT) == payload
    assert not list(tmp_path.rglob("*.tmp"))  # written under a temporary name, renamed into place
    fresh = BlockStore(tmp_path, max_bytes=1 << 20)  # a restart: from the file
    assert fresh.get(key, LAYOUT) == payload
    path = fresh.path_of(key)
    data = path.read_bytes()
    other = bytes(reversed(key))
    fresh.path_of(other).parent.mkdir(exist_ok=True)
    fresh.path_of(other).write_bytes(data)  # the right bytes under another name
    with pytest.raises(BlockStoreError, match="another key"):
        BlockStore(tmp_path, 1 << 20).get(other, LAYOUT)
    with pytest.raises(BlockStoreError, match="another layout"):
        BlockStore(tmp_path, 1 << 20).get(key, [[0, "k", "int8", [16, 2, 8]]])
    for broken, message in ((data[:-40], "short"), (data[:-10] + bytes([data[-10] ^ 1]) + data[-9:], "checksum"),
                            (b"x" * len(data), "not a TLKVBLK1 file"), (b"", "short")):
        path.write_bytes(broken)
        with pytest.raises(BlockStoreError, match=message):
            BlockStore(tmp_path, 1 << 20).get(key, LAYOUT)


def test_the_folder_stays_under_its_cap_least_recently_used_first(tmp_path):
    payload = os.urandom(4000)
    block = len(BlockStore.encode(b"k" * 24, LAYOUT, payload))
    store = BlockStore(tmp_path, max_bytes=10 * block)
    keys = [i.to_bytes(24, "little") for i in range(40)]
    for i, key in enumerate(keys):
        store.put(key, LAYOUT, payload)
        os.utime(store.path_of(key), (time.time() - 1000 + i,) * 2)  # (coarse clocks: the order made explicit)
        if i == 5:
            os.utime(store.path_of(keys[0]))  # read recently: kept
        total = sum(p.stat().st_size for p in tmp_path.rglob("*.kvb"))
        assert total <= 10 * block
    left = {p.name for p in tmp_path.rglob("*.kvb")}
    assert store.path_of(keys[-1]).name in left and store.path_of(keys[1]).name not in left
    assert store.path_of(keys[0]).name in left


def test_a_stale_temporary_file_is_swept_at_start(tmp_path):
    sub = tmp_path / "ab"
    sub.mkdir()
    stale = sub / "x.kvb.1.2.tmp"
    stale.write_bytes(b"half a block")
    os.utime(stale, (time.time() - 7200,) * 2)
    BlockStore(tmp_path, 1 << 20)
    assert not stale.exists()


# ---------------------------------------------------------------- the engine
PROMPTS = [[(7 * i + j) % 200 + 5 for j in range(150)] for i in range(3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {arch: str(build_tiny(arch, tmp_path_factory.mktemp(arch))) for arch in ("llama", "gemma3")}


def _run(model: str, prompts, rounds: int = 1, **kw):
    """(tokens and logprobs of each prompt, the engine's stats) from a fresh engine, shut down after; with
    `rounds` > 1 the prompts are generated that many times one after the other (the later rounds take
    their prefixes from the engine's own cache), and the last round's outputs are returned."""
    from turbollm import LLM, SamplingParams

    if kw.get("kv_cache_dtype") in ("int8", "int4"):
        kw["kv_recent_window"] = 16
    llm = LLM(model, kv_cache_memory=1 << 24, threads=2, **kw)
    try:
        for _ in range(rounds):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
                                use_tqdm=False)
        got = [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]
        return got, llm.engine.stats()
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch,kv", [("llama", "auto"), ("llama", "int8"), ("gemma3", "auto"), ("gemma3", "int4")])
def test_a_restarted_engine_loads_the_prefix_and_gives_the_same_output(tiny, tmp_path, arch, kv):
    model, store = tiny[arch], str(tmp_path / "store")
    # the references: the prompts computed whole, and taken from the engine's own prefix cache
    cold, _ = _run(model, PROMPTS, kv_cache_dtype=kv)
    want, _ = _run(model, PROMPTS, rounds=2, kv_cache_dtype=kv)
    first, s1 = _run(model, PROMPTS, kv_cache_dtype=kv, kv_store_path=store)
    assert first == cold
    assert s1["kv_blocks_saved"] > 0 and s1["kv_external_hit_tokens"] == 0
    got, s2 = _run(model, PROMPTS, kv_cache_dtype=kv, kv_store_path=store)  # a new engine: only the files remain
    assert got == want  # tokens and logprobs, bit for bit
    assert s2["kv_blocks_loaded"] > 0 and s2["kv_load_failures"] == 0 and s2["kv_blocks_saved"] == 0
    assert s2["kv_external_hit_tokens"] >= len(PROMPTS) * 128
    assert s2["prefix_cache_hits"] >= s2["kv_external_hit_tokens"]  # the loaded blocks, then taken as hits


def test_corrupt_blocks_are_recomputed_with_the_same_output_and_written_again(tiny, tmp_path):
    model, store = tiny["llama"], tmp_path / "store"
    cold, _ = _run(model, PROMPTS)
    want, _ = _run(model, PROMPTS, rounds=2)
    _run(model, PROMPTS, kv_store_path=str(store))
    files = sorted(store.rglob("*.kvb"))
    for f in files:  # one flipped byte in each block's payload
        data = bytearray(f.read_bytes())
        data[-10] ^= 0xFF
        f.write_bytes(bytes(data))
    got, s = _run(model, PROMPTS, kv_store_path=str(store))
    assert got == cold  # every prefix computed again
    assert s["kv_load_failures"] == len(PROMPTS) and s["kv_blocks_failed"] == len(files)
    assert s["kv_blocks_saved"] > 0  # the bad files were dropped and their blocks saved again
    got, s = _run(model, PROMPTS, kv_store_path=str(store))
    assert got == want and s["kv_blocks_loaded"] > 0 and s["kv_load_failures"] == 0


def test_blocks_of_another_kv_dtype_are_never_found(tiny, tmp_path):
    model, store = tiny["llama"], str(tmp_path / "store")
    _run(model, PROMPTS, kv_cache_dtype="float32", kv_store_path=store)
    _, s = _run(model, PROMPTS, kv_cache_dtype="float16", kv_store_path=store)
    assert s["kv_external_hit_tokens"] == 0 and s["kv_blocks_saved"] > 0


def test_a_consumer_only_loads_and_a_producer_only_saves(tiny, tmp_path):
    model, store = tiny["llama"], str(tmp_path / "store")

    def cfg(role):
        return {"kv_connector": "store", "kv_role": role, "kv_store_path": store}

    _, s = _run(model, PROMPTS, kv_transfer_config=cfg("kv_consumer"))
    assert s["kv_blocks_saved"] == 0 and not list(Path(store).rglob("*.kvb"))
    _, s = _run(model, PROMPTS, kv_transfer_config=cfg("kv_producer"))
    assert s["kv_blocks_saved"] > 0
    _, s = _run(model, PROMPTS, kv_transfer_config=cfg("kv_producer"))
    assert s["kv_external_hit_tokens"] == 0  # a producer does not load
    _, s = _run(model, PROMPTS, kv_transfer_config=cfg("kv_consumer"))
    assert s["kv_blocks_loaded"] > 0


@pytest.mark.slow  # a worker process
def test_a_worker_process_writes_its_blocks_before_it_exits(tiny, tmp_path):
    model, store = tiny["llama"], str(tmp_path / "store")
    want, _ = _run(model, PROMPTS, rounds=2)
    _run(model, PROMPTS, kv_store_path=store, distributed_executor_backend="mp")
    got, s = _run(model, PROMPTS, kv_store_path=store, distributed_executor_backend="mp")
    assert got == want and s["kv_blocks_loaded"] > 0
