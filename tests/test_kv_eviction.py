"""Attention-score eviction (issue 31, item 4: `kv_policy="h2o" | "snapkv"`, `kv_budget`)."""

from __future__ import annotations

import pytest
import torch

from quant_tiny import build_tiny
from turbollm import LLM, SamplingParams
from turbollm.attention.key_mass import KeyMass, accumulate_key_mass
from turbollm.attention.metadata import AttentionMetadata
from turbollm.core.kv_cache_manager import KVCacheManager
from turbollm.core.kv_eviction import SNAPKV_OBSERVE, SCORERS, choose_evictions
from turbollm.engine_args import EngineArgs
from turbollm.errors import InvalidRequestError


# ---------------------------------------------------------------- the scores
def _kernels():
    from turbollm.kernels import get_kernels

    k = get_kernels()
    assert k is not None, "the C++ kernels did not build"
    return k


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("impl", ["reference", "kernel-float32", "kernel-float16"])
def test_key_mass_is_the_softmax_mass_per_block(softcap, impl):
    """Two sequences over shuffled (compacted) tables, GQA, counted rows from the middle of a chunk: the mass
    per table entry equals the causal softmax probabilities summed over heads and counted rows (the PyTorch
    reference and the C++ kernel, float32 and float16 K)."""
    g = torch.Generator().manual_seed(0)
    Hq, Hk, D, bs, nb = 6, 2, 24, 4, 20
    k_cache = torch.randn(nb, bs, Hk, D, generator=g)
    if impl == "kernel-float16":
        k_cache = k_cache.half()
    lens, q_lens, first = [13, 9], [5, 9], [2, 0]  # seq 0 counts its last 3 rows, seq 1 all 9
    tables = [[7, 3, 12, 0], [5, 19, 2]]
    qsl = [0, 5, 14]
    q = torch.randn(qsl[-1], Hq, D, generator=g)
    width = max(map(len, tables))
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), qsl, lens,
                             torch.tensor([t + [0] * (width - len(t)) for t in tables]), bs)
    meta.key_mass = KeyMass([qsl[0] + first[0], qsl[1] + first[1]], torch.zeros(2, width))
    scale = D ** -0.5
    if impl == "reference":
        accumulate_key_mass(q, k_cache, meta, scale, softcap)
    else:
        _kernels().paged_key_mass(q, k_cache, meta.block_tables, torch.tensor(qsl), torch.tensor(lens),
                                  torch.tensor(meta.key_mass.first_rows), scale, softcap or 0.0, meta.key_mass.out)
    for i in range(2):
        k = torch.cat([k_cache[b] for b in tables[i]])[:lens[i]].float()  # [S, Hk, D]
        want = torch.zeros(lens[i])
        for r in range(qsl[i] + first[i], qsl[i + 1]):
            pos = lens[i] - (qsl[i + 1] - r)  # the row's own slot
            for h in range(Hq):
                s = (k[:pos + 1, h // (Hq // Hk)] @ q[r, h]) * scale
                if softcap:
                    s = torch.tanh(s / softcap) * softcap
                want[:pos + 1] += torch.softmax(s, 0)
        per_block = torch.nn.functional.pad(want, (0, len(tables[i]) * bs - lens[i])).view(-1, bs).sum(1)
        torch.testing.assert_close(meta.key_mass.out[i, :len(tables[i])], per_block, rtol=1e-5, atol=1e-5)
        rows = qsl[i + 1] - qsl[i] - first[i]
        assert meta.key_mass.out[i].sum().item() == pytest.approx(rows * Hq, rel=1e-5)  # each row's heads sum to 1


def test_choose_evictions_lowest_outside_the_recent_blocks():
    scores = [5.0, 0.5, 3.0, 0.5, 9.0, 0.1, 0.0]
    # 7 entries, budget 4, entries 5.. protected: the three lowest of 0..4 (ties: the older)
    assert choose_evictions(scores, 7, 5, 4) == [3, 2, 1]
    assert choose_evictions(scores, 4, 5, 4) == []
    assert choose_evictions(scores, 7, 1, 2) == [0]  # only what is outside the protected entries


def test_scorers_accumulate_and_drop_entries():
    h2o, snap = SCORERS["h2o"], SCORERS["snapkv"]
    st = h2o.observe(None, [1.0, 2.0], 4)
    st = h2o.observe(st, [1.0, 1.0, 5.0], 1)
    assert h2o.scores(st, 4) == [2.0, 3.0, 5.0, 0.0]
    h2o.remove(st, [1])
    assert h2o.scores(st, 2) == [2.0, 5.0]
    # SnapKV: the steps holding the last SNAPKV_OBSERVE rows vote: a prompt chunk's rows until as many
    # decode rows came after them
    st = snap.observe(None, [4.0, 4.0], SNAPKV_OBSERVE)
    st = snap.observe(st, [1.0, 0.0, 2.0], 1)
    assert snap.scores(st, 3) == [5.0, 4.0, 2.0]
    for _ in range(SNAPKV_OBSERVE - 1):
        st = snap.observe(st, [1.0, 0.0, 2.0], 1)
    assert len(st) == SNAPKV_OBSERVE and snap.scores(st, 3) == [32.0, 0.0, 64.0]


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, flag", [
    (dict(kv_policy="h2o"), "kv_budget"),
    (dict(kv_policy="snapkv", kv_budget=16), "kv_budget 16"),  # a block
    (dict(kv_policy="snapkv", kv_budget=40), "kv_budget 40"),  # not more than the recent 32 + a block
    (dict(kv_budget=64), "kv_budget applies to kv_policy 'h2o' or 'snapkv'"),
    (dict(kv_policy="h2o", kv_budget=64, kv_window=32), "kv_window applies"),
    (dict(kv_policy="h2o", kv_budget=64, kv_cache_dtype="int8"), "does not take quantized K/V"),
    (dict(kv_policy="h2o", kv_budget=64, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative"),
])
def test_bad_options_are_refused_before_loading(kw, flag):
    with pytest.raises(InvalidRequestError, match=flag):
        EngineArgs(model="no-such-model", **kw)


# ---------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("evict"))


def _llm(path, **kw):
    return LLM(str(path), max_num_seqs=2, max_num_batched_tokens=32, **kw)


def _logprobs(out) -> list[float]:
    return ([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
            + [next(iter(d.values())).logprob for d in out.outputs[0].logprobs])


def test_fused_step_equals_the_modules(tiny_llama):
    """Decodes under h2o run in the fused C++ step, which adds the key mass per layer: the same evictions and
    bit-identical logprobs as the modules."""
    prompt = [int(t) for t in torch.randint(4, 90, (100,), generator=torch.Generator().manual_seed(8))]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=0)
    outs, evicted = [], []
    for eager in (False, True):
        llm = _llm(tiny_llama, kv_policy="h2o", kv_budget=48, enforce_eager=eager)
        outs.append(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0])
        evicted.append(llm.engine.kv_manager.num_evicted_blocks)
        if not eager:
            assert llm.engine.executor.worker.runner.fused.steps > 50  # the decodes ran fused
    assert evicted[0] == evicted[1] >= 6
    assert outs[0].token_ids == outs[1].token_ids
    assert [next(iter(d.values())).logprob for d in outs[0].logprobs] == \
        [next(iter(d.values())).logprob for d in outs[1].logprobs]


def test_one_sequence_engine_with_a_chunk_longer_than_its_context(tiny_llama):
    """The default pool of a one-sequence engine (what eval uses) holds its whole context; the budget plus a
    2048-token chunk would need more, and a sequence alone never needs more than its context (before: the
    engine refused to start)."""
    llm = LLM(str(tiny_llama), kv_policy="h2o", kv_budget=64, max_num_seqs=1, max_model_len=128,
              max_num_batched_tokens=2048)
    out = llm.generate([{"prompt_token_ids": list(range(4, 110))}], SamplingParams(max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8 and llm.engine.kv_manager.num_evicted_blocks > 0


def test_budget_above_the_length_changes_nothing(tiny_llama):
    prompt = [int(t) for t in torch.randint(4, 90, (70,), generator=torch.Generator().manual_seed(1))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    ref = _llm(tiny_llama, enable_prefix_caching=False).generate([{"prompt_token_ids": prompt}], params,
                                                                 use_tqdm=False)[0]
    for policy in ("h2o", "snapkv"):
        llm = _llm(tiny_llama, kv_policy=policy, kv_budget=128)
        got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert llm.engine.kv_manager.num_evicted_blocks == 0
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        assert max(abs(a - b) for a, b in zip(_logprobs(got), _logprobs(ref))) < 1e-4


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_evicted_run_equals_masked_dense_attention(tiny_llama, policy, monkeypatch):
    """The oracle: transformers over the whole sequence with a 4-D mask that hides, from each row, the
    blocks evicted before the step that computed it (read from the manager's decisions). Every prompt and
    generated logprob agrees, so compacted tables, slots and positions are right; memory stays within
    the budget plus a chunk."""
    import transformers

    log: list[tuple[int, list[int]]] = []  # (computed tokens when evicted, logical blocks evicted)
    logical: list[int] = []
    real_evict = KVCacheManager.evict

    def evict(self, seq):
        table = self.tables(seq)[0]
        while len(logical) < len(table):
            logical.append(logical[-1] + 1 if logical else 0)
        gone = real_evict(self, seq)
        log.append((seq.num_computed_tokens, [logical[i] for i in gone]))
        for i in gone:
            del logical[i]
        return gone

    monkeypatch.setattr(KVCacheManager, "evict", evict)
    prompt = [int(t) for t in torch.randint(4, 90, (150,), generator=torch.Generator().manual_seed(2))]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    llm = _llm(tiny_llama, kv_policy=policy, kv_budget=64)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    kv = llm.engine.kv_manager
    assert kv.num_evicted_blocks >= 8
    bs = kv.block_size
    assert llm.engine.stats()["kv_cache_bytes_peak"] <= (64 // bs + 32 // bs + 1) * kv.block_bytes[0]

    ids = prompt + list(out.outputs[0].token_ids)
    n = len(ids) - 1  # the last token's K/V are never computed
    visible = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for computed, blocks in log:
        for b in blocks:
            visible[computed:, b * bs:(b + 1) * bs] = False
    mask = torch.zeros(1, 1, n, n).masked_fill(~visible, float("-inf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32,
                                                           attn_implementation="eager")
    with torch.no_grad():
        logits = hf(torch.tensor([ids[:n]]), attention_mask=mask, position_ids=torch.arange(n)[None]).logits[0]
    want = torch.log_softmax(logits.float(), -1)[torch.arange(n), torch.tensor(ids[1:])]
    got = torch.tensor(_logprobs(out))
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 2e-3


def test_siblings_and_concurrent_requests_through_the_server(tiny_llama):
    """`turbollm serve` with h2o: concurrent long requests and an n = 2 request (siblings sharing blocks, each
    evicting on its own) finish; /metrics counts the evictions and shows the K/V bytes in use back at 0."""
    import asyncio
    import re

    import httpx
    from turbollm.engine_args import EngineArgs
    from turbollm.engine.llm_engine import LLMEngine
    from turbollm.entrypoints.async_engine import AsyncLLMEngine
    from turbollm.server.app import ServerSettings, build_app

    aengine = AsyncLLMEngine(LLMEngine(EngineArgs(model=str(tiny_llama), threads=1, max_num_seqs=4,
                                                  max_num_batched_tokens=32, kv_policy="h2o", kv_budget=48)))
    app = build_app(aengine, ServerSettings(served_model_names=["tiny"]))
    prompt, other = (" ".join(f"w{t}" for t in torch.randint(4, 90, (120,), generator=torch.Generator().manual_seed(s))
                              .tolist()) for s in (6, 7))

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
            outs = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in
                                          (body, {**body, "prompt": other},
                                           {**body, "n": 2, "temperature": 1.0, "seed": 3})))
            return outs, (await client.get("/metrics")).text

    try:
        outs, text = asyncio.run(go())
    finally:
        aengine.shutdown_sync(timeout=10)
    for r in outs:
        assert r.status_code == 200, r.text
        assert all(c["finish_reason"] == "length" for c in r.json()["choices"])
    assert len(outs[2].json()["choices"]) == 2
    values = {m.group(1): float(m.group(2)) for m in re.finditer(r"^turbollm:([a-z_]+)\{[^}]*\} (\S+)$", text, re.M)}
    assert values["kv_evicted_blocks_total"] >= 4 * 6  # 4 sequences of 160 tokens, 48 kept: about 7 blocks each
    assert values["kv_cache_bytes_used"] == 0


@pytest.mark.model
def test_sliding_window_model_is_refused_before_loading(monkeypatch):
    """Gemma 3's sliding layers cannot take an eviction policy: the engine says so from the model's config,
    before any weights load."""
    from conftest import catalog_model_path

    import turbollm.engine.llm_engine as llm_engine

    def no_load(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(llm_engine, "load_model", no_load)
    with pytest.raises(InvalidRequestError, match="full-attention layers only; this model has 512-token sliding"):
        LLM(str(catalog_model_path("gemma3-270m")), kv_policy="h2o", kv_budget=256)
