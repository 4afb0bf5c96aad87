"""Quantized K/V (issue 31, item 1: kv_cache_dtype int8 / int4 with a float16 recent window).

- the formats: round-trip error within half a step, scales in float16, int4 packing, bytes per token;
- the store: over a prefill chunk and decodes, every position below the quantized bound reads back
  as its block's quantization of the true K/V, every newer one as its float16 value, for several
  sequences with their own rings (the reference, then the C++ kernels against it);
- through the engine: close to float16 K/V on a tiny model, forks and preemption keep their rings,
  prefix hits only on quantized blocks; bad options refused before loading.
"""

from __future__ import annotations

import pytest
import torch

from turbollm.attention.kv_formats import KV_FORMATS, kv_format
from turbollm.attention.kv_quant import RecentMeta, gather_reference, write_reference
from turbollm.attention.kv_storage import KVLayout, LayerKVCache
from turbollm.engine_args import EngineArgs
from turbollm.errors import InvalidRequestError

FORMATS = {f.name: f for f in KV_FORMATS.values()}  # the registered K/V formats by kv_cache_dtype name


@pytest.mark.parametrize("quant,levels", [("int8", 127), ("int4", 15)])
def test_round_trip_within_half_a_step(quant, levels):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, 2, 64, generator=g) * torch.linspace(0.1, 8, 64)  # outlier channels
    x[1, :, :, 5] = 0.0  # an all-zero channel: scale 0, no NaN
    fmt = FORMATS[quant]
    kq, ks = fmt.quantize_k(x)
    kd = fmt.dequantize_k(kq, ks)
    step_k = ks.float() if quant == "int8" else ks[:, 0].float()
    assert torch.isfinite(kd).all()
    assert ((kd - x).abs() <= step_k[:, None] * 0.5 + 1e-6 + x.abs() * 1e-3).all()
    vq, vs = fmt.quantize_v(x)
    vd = fmt.dequantize_v(vq, vs)
    step_v = vs.float() if quant == "int8" else vs[..., 0].float()
    assert ((vd - x).abs() <= step_v[..., None] * 0.5 + 1e-6 + x.abs() * 1e-3).all()
    assert kq.dtype == (torch.int8 if quant == "int8" else torch.uint8) and ks.dtype == torch.float16
    if quant == "int4":
        assert kq.shape[-1] == 32 and vq.shape[-1] == 32  # two values a byte


def test_formats_are_registered_by_storage_dtype():
    assert {f.name: (f.dtype, f.bits) for f in KV_FORMATS.values()} == {
        "float32": (torch.float32, 0), "float16": (torch.float16, 0), "int8": (torch.int8, 8), "int4": (torch.uint8, 4)}
    assert KVLayout(torch.uint8, 32, 2, 64, 128).format is kv_format(torch.uint8)
    with pytest.raises(ValueError, match="no K/V storage format"):
        kv_format(torch.bfloat16)


def test_bytes_per_token_against_float16():
    """Head dim 64, 32-token blocks: int8 0.523x, int4 0.297x of float16, scales included."""
    f16 = KVLayout(torch.float16, 32, 2, 64).bytes_per_token
    assert KVLayout(torch.int8, 32, 2, 64, 128).bytes_per_token / f16 == pytest.approx(134 / 256)
    assert KVLayout(torch.uint8, 32, 2, 64, 128).bytes_per_token / f16 == pytest.approx(76 / 256)
    assert KVLayout(torch.int8, 16, 2, 64).bytes_per_token / f16 > 0.53  # why quantized K/V takes 32-token blocks


def _simulate(quant, steps, R=20, bs=8, H=2, D=16, nseq=2, seed=0, write=write_reference):
    """Sequences computing `steps` new tokens each step; returns the cache, tables, true K/V, meta."""
    g = torch.Generator().manual_seed(seed)
    lay = KVLayout(torch.int8 if quant == "int8" else torch.uint8, bs, H, D, R)
    total = sum(steps)
    nblk = -(-total // bs)
    first_ring = -(-(nseq * nblk + 1) // lay.ring_pool_blocks)  # the rings' blocks after the data's
    cache = LayerKVCache.allocate(lay, (first_ring + nseq + 1) * lay.ring_pool_blocks)
    perm = torch.randperm(nseq * nblk, generator=g) + 1
    tables = perm.view(nseq, nblk)
    truth = (torch.randn(nseq, total, 2, H, D, generator=g) * 3).half().float()  # the ring's float16 is exact
    qlo, c = [0] * nseq, 0
    slots = [first_ring + 2, first_ring][:nseq]
    for n in steps:
        new = [max(q, (c + n - R) // bs * bs) for q in qlo]
        meta = RecentMeta(slots, [c] * nseq, list(qlo), new, [hi for hi in new for _ in range(n)])
        k = truth[:, c:c + n, 0].reshape(-1, H, D)
        v = truth[:, c:c + n, 1].reshape(-1, H, D)
        write(k, v, cache, tables, [i * n for i in range(nseq + 1)], meta)
        qlo, c = new, c + n
    return cache, tables, truth, qlo, slots, c


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_store_quantizes_what_left_the_window_and_keeps_the_rest(quant):
    cache, tables, truth, qlo, slots, L = _simulate(quant, [37, 1, 1, 5, 1, 12, 1, 1, 1])
    bs = cache.layout.block_size
    for i in range(len(slots)):
        assert qlo[i] == (L - 20) // bs * bs
        k, v = gather_reference(cache, tables[i], slots[i], qlo[i], L)
        tk, tv = truth[i, :, 0], truth[i, :, 1]
        nb = qlo[i] // bs
        fmt = FORMATS[quant]
        want_k = fmt.dequantize_k(*fmt.quantize_k(tk[:qlo[i]].view(nb, bs, *tk.shape[1:]))).flatten(0, 1)
        want_v = fmt.dequantize_v(*fmt.quantize_v(tv[:qlo[i]]))
        torch.testing.assert_close(k[:qlo[i]], want_k)
        torch.testing.assert_close(v[:qlo[i]], want_v)
        torch.testing.assert_close(k[qlo[i]:], tk[qlo[i]:].half().float())  # the recent window: float16
        torch.testing.assert_close(v[qlo[i]:], tv[qlo[i]:].half().float())


@pytest.mark.parametrize("kw,message", [
    (dict(kv_cache_dtype="float16", kv_recent_window=64), "kv_recent_window applies"),
    (dict(kv_cache_dtype="int8", kv_recent_window=-1), "kv_recent_window must be"),
    (dict(kv_cache_dtype="int4", kv_recent_window=2, speculative_config={"method": "ngram",
                                                                          "num_speculative_tokens": 3}),
     "more than num_speculative_tokens"),
    (dict(kv_cache_dtype="int8", kv_policy="streaming", kv_window=64), "streaming"),
    (dict(kv_cache_dtype="int3"), "kv_cache_dtype 'int3'"),
])
def test_bad_options_refused_before_loading(kw, message):
    with pytest.raises(InvalidRequestError, match=message):
        EngineArgs(model="no-such-model", **kw)


def test_defaults():
    args = EngineArgs(model="x", kv_cache_dtype="int4")
    assert args.block_size == 32 and args.kv_recent_window == 128
    assert EngineArgs(model="x").block_size == 16


def _kernel_writer(kernels):
    def write(k, v, cache, tables, qsl, meta):
        kernels.paged_write_kv_quant(k, v, cache.k, cache.v, cache.k_scale, cache.v_scale, cache.k_recent,
                                     cache.v_recent, tables, torch.tensor(qsl), torch.tensor(meta.slots),
                                     torch.tensor(meta.first_pos), torch.tensor(meta.qlo_old),
                                     torch.tensor(meta.qlo_new), cache.layout.ring_blocks,
                                     8 if cache.layout.quant == "int8" else 4)
    return write


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_kernel_store_is_the_reference_bit_for_bit(quant):
    from conftest import require_kernels

    kernels = require_kernels()
    steps = [37, 1, 1, 5, 1, 12, 1, 1, 1]
    ref = _simulate(quant, steps)[0]
    got = _simulate(quant, steps, write=_kernel_writer(kernels))[0]
    for name in ("k", "v", "k_scale", "v_scale", "k_recent", "v_recent"):  # bit for bit (the rings are a float16
        # view of the pool's bytes: where a data block lies under it, its bytes may read as NaN)
        assert torch.equal(getattr(got, name).view(torch.uint8), getattr(ref, name).view(torch.uint8)), name


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("q_lens", [[1, 1], [5, 3], [20, 9]])  # decodes, a few tokens (decode kernel), chunks (tiled)
@pytest.mark.parametrize("window", [None, 24])
def test_kernel_attention_matches_the_reference(quant, q_lens, window):
    """After a long prefill and decodes, a step of q_lens new tokens per sequence: the kernels' attention
    over the pool (below qlo) and the rings (above) equals the reference's within float rounding."""
    from conftest import require_kernels
    from turbollm.attention.backend import CPUKernelAttentionBackend, TorchAttentionBackend
    from turbollm.attention.metadata import AttentionMetadata

    require_kernels()
    steps = [45, 1, 1, 3] + [max(q_lens)]
    cache, tables, truth, qlo, slots, L = _simulate(quant, steps, H=2, D=16)
    # the last step wrote max(q_lens) tokens per sequence; attend with q_lens[i] of them as new
    g = torch.Generator().manual_seed(3)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], 6, 16, generator=g)
    meta = AttentionMetadata(torch.zeros(qsl[-1], dtype=torch.int64), qsl, [L] * len(q_lens), tables,
                             cache.layout.block_size)
    rows = [(p + 1 - 20) // 8 * 8 for n in q_lens for p in range(L - n, L)]  # each row's own ring bound
    meta.recent = RecentMeta(slots, [L - n for n in q_lens], list(qlo), list(qlo), rows)
    want = TorchAttentionBackend().forward_quant(q, cache, meta, 0.3, window, None)
    got = CPUKernelAttentionBackend().forward_quant(q, cache, meta, 0.3, window, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from quant_tiny import build_tiny

    return build_tiny("llama", tmp_path_factory.mktemp("kvquant"))


def _gen(path, prompts, params, **kw):
    from turbollm import LLM

    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=64, **kw)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _prompts(*lens):
    return [torch.randint(4, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lens]


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_engine_fused_step_equals_the_modules(tiny_llama, quant):
    """Decodes through the C++ step read and write the quantized pool and the rings as the modules do."""
    from turbollm import SamplingParams

    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)
    runs = []
    for eager in (False, True):
        llm, outs = _gen(tiny_llama, _prompts(150, 70), p, kv_cache_dtype=quant, kv_recent_window=16,
                         enforce_eager=eager)
        runs.append([(o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                     for o in outs])
        if not eager:
            assert llm.engine.executor.worker.runner.fused.steps > 30
    assert runs[0] == runs[1]


def test_engine_int8_close_to_float16_and_forks_preemption_prefix_hits(tiny_llama):
    """int8 K/V: the same greedy tokens as float16 K/V on a tiny model, top logprobs within 0.05; n = 2
    siblings (each its own ring), a pool so small that sequences are preempted and recomputed, and a
    second identical prompt that hits the prefix cache on quantized blocks only."""
    from turbollm import SamplingParams

    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    prompts = _prompts(120, 90, 100)
    _, ref = _gen(tiny_llama, prompts, p, kv_cache_dtype="float16")
    llm, got = _gen(tiny_llama, prompts, p, kv_cache_dtype="int8", kv_recent_window=32)
    for a, b in zip(ref, got):
        la = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        lb = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        n = next((i for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)) if x != y), len(la))
        assert n >= 8 and max(abs(x - y) for x, y in zip(la[:n], lb[:n])) < 0.05
    # the prefix cache holds only quantized blocks: 120 + 24 tokens computed, the last 32 in the ring, so
    # blocks 0-2 (96 tokens, all of the prompt's full blocks) are cached
    stats0 = llm.engine.stats()["prefix_cache_hits"]
    again = llm.generate([{"prompt_token_ids": prompts[0]}], p, use_tqdm=False)[0]
    assert llm.engine.stats()["prefix_cache_hits"] - stats0 == 96
    assert again.outputs[0].token_ids[:4] == got[0].outputs[0].token_ids[:4]
    # a prompt that stops after one token: 101 computed, positions 69-100 still in the ring at its end, so
    # only blocks 0-1 (64 tokens) were quantized and cached
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    fresh = _prompts(100, 1)[0]
    llm.generate([{"prompt_token_ids": fresh}], one, use_tqdm=False)
    stats0 = llm.engine.stats()["prefix_cache_hits"]
    llm.generate([{"prompt_token_ids": fresh}], one, use_tqdm=False)
    assert llm.engine.stats()["prefix_cache_hits"] - stats0 == 64
    # forks and preemption: n = 2 greedy siblings agree; 8 blocks beside the four rings force preemption
    pn = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, n=2)
    small, outs = _gen(tiny_llama, prompts[:2], pn, kv_cache_dtype="int8", kv_recent_window=32,
                       kv_cache_memory=small_pool_bytes(tiny_llama, 8))
    assert small.engine.stats()["num_preemptions"] > 0
    for o in outs:
        assert o.outputs[0].token_ids == o.outputs[1].token_ids
    _, alone = _gen(tiny_llama, prompts[:2], pn, kv_cache_dtype="int8", kv_recent_window=32)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]


def small_pool_bytes(path, blocks: int) -> int:
    """The budget of `blocks` int8 blocks and the rings of 4 running sequences (taken from the same pool)."""
    from turbollm.core.kv_sizing import kv_config_for_model
    from turbollm.loader import describe_model

    cfg = describe_model(str(path)).config
    ring = kv_config_for_model(cfg, 1, 32, torch.int8, recent_window=32).ring_blocks
    return kv_config_for_model(cfg, blocks + 4 * ring, 32, torch.int8, recent_window=32).total_bytes


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_speculation_stays_token_exact(tiny_llama, quant):
    """n-gram drafts verified in one step read the ring as plain decodes would (each row from its own
    bound; a rejected draft's early quantization is not read): the same tokens and logprobs as without
    speculation. (Before the per-row bound, int8 differed by 6e-3 in logprob and int4 diverged.)"""
    from turbollm import SamplingParams

    prompt = [5, 6, 7, 8, 9] * 30 + _prompts(40)[0]  # repetitive: the n-gram proposer drafts often
    p = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, logprobs=0)
    runs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}):
        llm, outs = _gen(tiny_llama, [prompt], p, kv_cache_dtype=quant, kv_recent_window=5,
                         speculative_config=spec)
        o = outs[0].outputs[0]
        runs.append((o.token_ids, [next(iter(d.values())).logprob for d in o.logprobs]))
        if spec:
            stats = llm.engine.stats()  # drafts verified (rejected ones advance the quantized bound too)
            assert stats["spec_decode_num_draft_tokens"] > 10, stats
    assert runs[0] == runs[1]


SMOLLM2 = dict(arch="llama", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
               intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=100000.0, tie_word_embeddings=True)  # smollm2-135m's shapes


@pytest.mark.parametrize("quant,least", [("int8", 1.85), ("int4", 3.2)])
def test_quantized_kv_holds_its_share_of_float16_tokens(quant, least):
    """The rings come out of the pool as sequences run, not reserved per sequence slot up front: in 3.5 GiB,
    int8 K/V holds >= 1.85x and int4 >= 3.2x the tokens float16 holds (smollm2-135m's shapes, each format
    at its default block size), and both start at 0.25 GiB with the default max_num_seqs (64)."""
    from turbollm.config import ModelConfig
    from turbollm.core.kv_sizing import size_kv_cache
    from turbollm.engine_args import EngineArgs

    cfg = ModelConfig(**SMOLLM2)

    def size(dtype: str, gib: float):
        args = EngineArgs(kv_cache_dtype=dtype, kv_cache_memory=int(gib * (1 << 30)))
        return size_kv_cache(args, cfg, args.kv_torch_dtype(), b"")

    f16, _ = size("float16", 3.5)
    kv, _ = size(quant, 3.5)
    assert kv.total_bytes <= 3.5 * (1 << 30) and kv.num_tokens >= least * f16.num_tokens, \
        (kv.num_tokens, f16.num_tokens)
    small, model_len = size(quant, 0.25)  # (before, 64 rings reserved up front did not fit)
    assert model_len == cfg.max_position_embeddings and small.ring_slots >= 40  # as many run as memory holds


def test_a_budget_below_one_ring_is_refused():
    from turbollm.config import ModelConfig
    from turbollm.core.kv_sizing import kv_config_for_model, size_kv_cache
    from turbollm.engine_args import EngineArgs

    cfg = ModelConfig(**SMOLLM2)
    ring = kv_config_for_model(cfg, 1, 32, torch.int8, recent_window=128).ring_blocks
    block = kv_config_for_model(cfg, 1, 32, torch.int8, recent_window=128).total_bytes
    with pytest.raises(InvalidRequestError, match="float16 ring of recent tokens takes"):
        size_kv_cache(EngineArgs(kv_cache_dtype="int8", kv_cache_memory=ring * block), cfg, torch.int8, b"")
    kv, model_len = size_kv_cache(EngineArgs(kv_cache_dtype="int8", kv_cache_memory=(ring + 2) * block), cfg,
                                  torch.int8, b"")
    assert kv.ring_slots == 1 and model_len == 2 * 32  # one sequence: its ring and two blocks


def test_sliding_window_model_with_quantized_kv(tmp_path_factory):
    """Gemma 3 (sliding layers of a 16-token window, released as it moves) with int8 K/V and a recent
    window longer than the sliding one (its blocks leave the window before they are quantized: skipped):
    fused step = modules, and close to float16 K/V."""
    from quant_tiny import build_tiny
    from turbollm import SamplingParams

    path = build_tiny("gemma3", tmp_path_factory.mktemp("kvquant_gemma"))
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=0)
    prompts = _prompts(110, 75)
    runs = {}
    for name, kw in (("float16", dict(kv_cache_dtype="float16")),
                     ("fused", dict(kv_cache_dtype="int8", kv_recent_window=40)),
                     ("eager", dict(kv_cache_dtype="int8", kv_recent_window=40, enforce_eager=True))):
        _, outs = _gen(path, prompts, p, **kw)
        runs[name] = [(o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                      for o in outs]
    assert runs["fused"] == runs["eager"]
    for (ta, la), (tb, lb) in zip(runs["float16"], runs["fused"]):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        assert n >= 5 and max(abs(x - y) for x, y in zip(la[:n], lb[:n])) < 0.05
