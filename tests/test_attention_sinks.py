"""Attention sinks + a window (issue 31, item 3: `kv_policy="streaming"`).

K is stored after RoPE at its original position; the kernels score the window with the query as it
is and the sinks with the query rotated to min(p, sinks + window - 1). Checked here:
- that this is StreamingLLM's attention with positions re-assigned within the cache (sinks 0 .. S-1,
  window S .. S+W-1, the query last), against an oracle that rotates pre-RoPE keys at those positions;
- the C++ kernels (decode, decode of a few tokens, tiled; split and unsplit; float16 K/V) against the
  reference, with the released blocks between sinks and window filled with NaN (never read);
- through the engine: flat KV memory over a sequence several times the window and past the model's
  trained context, the kernels equal to the torch backend, and the same outputs as "auto" while the
  sequence is shorter than sinks + window (nothing released yet);
- the policy's bad options, refused before anything loads.
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_kernels
from quant_tiny import build_tiny
from test_attention import _random_paged
from turbollm import LLM, SamplingParams
from turbollm.attention.backend import attend_one, gather_kv
from turbollm.engine_args import EngineArgs
from turbollm.errors import InvalidRequestError
from turbollm.layers.rotary import RotaryEmbedding


def _rope(x: torch.Tensor, pos: torch.Tensor, rot: RotaryEmbedding) -> torch.Tensor:
    return rot.rotate_q(pos, x.clone())


def test_positions_are_streamingllms():
    """Our attention (post-RoPE K at original positions, q_sink for the sinks) equals StreamingLLM's
    re-assigned positions (pre-RoPE K rotated at its place in the cache), for every query position."""
    S, W, L, Hq, Hk, D = 3, 8, 30, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q0, k0, v = (torch.randn(L, h, D, generator=g) for h in (Hq, Hk, Hk))
    rot = RotaryEmbedding(D, 64, 10000.0)
    rot(torch.arange(L), q0.clone(), k0.clone())  # grow the tables
    pos = torch.arange(L)
    q, k = _rope(q0, pos, rot), _rope(k0, pos, rot)
    q_sink = _rope(q0, pos.clamp(max=S + W - 1), rot)
    ours = attend_one(q, k, v, 0.25, 0, W, None, S, q_sink)
    for p in range(L):
        if p < S + W:  # nothing evicted yet: plain causal attention at the original positions
            keys, vals, qp = k[:p + 1], v[:p + 1], q[p:p + 1]
        else:  # the cache holds the sinks and the last W tokens, numbered 0 .. S+W-1
            idx = list(range(S)) + list(range(p - W + 1, p + 1))
            keys = _rope(k0[idx], torch.arange(S + W), rot)
            vals, qp = v[idx], _rope(q0[p:p + 1], torch.tensor([S + W - 1]), rot)
        want = attend_one(qp, keys, vals, 0.25, keys.shape[0] - 1, None, None)
        torch.testing.assert_close(ours[p:p + 1], want, rtol=1e-5, atol=1e-5, msg=f"position {p}")


def _paged_with_gap(lens, q_lens, S, W, Hq=6, Hk=2, D=32, bs=4, seed=0):
    """Random paged K/V whose blocks wholly between the sinks and the oldest window are NaN (released)."""
    q, kc, vc, meta = _random_paged(lens, q_lens, Hq, Hk, D, bs, seed=seed)
    q_sink = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1))
    for i, n in enumerate(lens):
        first_new = n - q_lens[i]
        lo = max(0, first_new - W + 1)  # the oldest position any of its new tokens sees
        for blk in range(-(-S // bs), lo // bs):
            b = int(meta.block_tables[i, blk])
            kc[b], vc[b] = float("nan"), float("nan")
    return q, q_sink, kc, vc, meta


def _reference(q, q_sink, kc, vc, meta, scale, W, S):
    outs = []
    for i in range(meta.num_seqs):
        s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        n = meta.seq_lens[i]
        k = torch.nan_to_num(gather_kv(kc, meta.block_tables[i], n), nan=1e4)  # a NaN read would show
        v = torch.nan_to_num(gather_kv(vc, meta.block_tables[i], n), nan=1e4)
        outs.append(attend_one(q[s:e], k, v, scale, n - (e - s), W, None, S, q_sink[s:e]))
    return torch.cat(outs)


CASES = [  # (lens, new tokens per sequence)
    ([90], [1]),  # a decode far past the window
    ([7, 50, 200], [1, 1, 1]),  # decodes: within the window, past it, far past it
    ([120, 60], [5, 8]),  # a few tokens each (verification, a prompt's tail)
    ([300], [40]),  # a prefill chunk whose rows cross from overlap to gap
    ([40, 400, 33], [40, 3, 17]),  # mixed; a short whole prompt
]


@pytest.mark.parametrize("lens,q_lens", CASES)
@pytest.mark.parametrize("S,W", [(4, 16), (1, 33), (6, 64)])
def test_kernels_match_reference_and_skip_released_blocks(lens, q_lens, S, W):
    kernels = require_kernels()
    q, q_sink, kc, vc, meta = _paged_with_gap(lens, q_lens, S, W, seed=len(lens) + W)
    want = _reference(q, q_sink, kc, vc, meta, 0.2, W, S)
    starts, sl = torch.tensor(meta.query_start_loc), torch.tensor(meta.seq_lens)
    tiled = kernels.paged_attention(q, kc, vc, meta.block_tables, starts, sl, 0.2, W, 0.0, S, q_sink)
    torch.testing.assert_close(tiled.reshape(q.shape[0], -1), want, rtol=1e-5, atol=2e-5)
    if max(q_lens) <= kernels.small_query_max:
        dec = kernels.paged_decode_attention(q, kc, vc, meta.block_tables, sl, 0.2, W, 0.0,
                                             None if q.shape[0] == len(lens) else starts, S, q_sink)
        torch.testing.assert_close(dec.reshape(q.shape[0], -1), want, rtol=1e-5, atol=2e-5)


def test_split_tasks_float16_and_one_thread():
    """One long sequence with few new tokens splits its keys over tasks: the sinks go to the first part."""
    kernels = require_kernels()
    q, q_sink, kc, vc, meta = _paged_with_gap([3000], [12], 4, 1024, Hq=4, Hk=1, D=64, bs=16, seed=5)
    kc, vc = kc.half(), vc.half()
    want = _reference(q, q_sink, kc.float(), vc.float(), meta, 0.125, 1024, 4)
    n = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = kernels.paged_attention(q, kc, vc, meta.block_tables, torch.tensor(meta.query_start_loc),
                                          torch.tensor(meta.seq_lens), 0.125, 1024, 0.0, 4, q_sink)
            torch.testing.assert_close(got.reshape(12, -1), want, rtol=1e-5, atol=2e-5)
    finally:
        torch.set_num_threads(n)


def test_kernels_refuse_sinks_without_window_or_q_sink():
    kernels = require_kernels()
    q, kc, vc, meta = _random_paged([20], [1], 2, 1, 8, 4)
    sl = torch.tensor(meta.seq_lens)
    with pytest.raises(RuntimeError, match="sinks"):
        kernels.paged_decode_attention(q, kc, vc, meta.block_tables, sl, 0.3, -1, 0.0, None, 4, q)
    with pytest.raises(RuntimeError, match="sinks"):
        kernels.paged_decode_attention(q, kc, vc, meta.block_tables, sl, 0.3, 8, 0.0, None, 4, None)


@pytest.mark.parametrize("kw,flag", [
    (dict(kv_policy="streaming"), "kv_window"),
    (dict(kv_policy="streaming", kv_window=8), "kv_window 8"),  # under a block (16)
    (dict(kv_policy="streaming", kv_window=32, attention_sinks=40), "attention_sinks"),
    (dict(kv_policy="streaming", kv_window=32, attention_sinks=-1), "attention_sinks"),
    (dict(kv_window=64), "kv_window applies to kv_policy 'streaming'"),
    (dict(kv_policy="dense", attention_sinks=4), "attention_sinks applies"),
    (dict(kv_policy="streaming", kv_window=64, speculative_config={"method": "draft_model", "model": "x",
                                                                   "num_speculative_tokens": 2}), "draft model"),
])
def test_bad_options_are_refused_before_loading(kw, flag):
    with pytest.raises(InvalidRequestError, match=flag):
        EngineArgs(model="no-such-model", **kw)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("sinks"))


def _llm(path, **kw):
    return LLM(str(path), max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=False, **kw)


def test_engine_flat_memory_past_the_trained_context(tiny_llama):
    """A sequence far past the window and the model's trained context: the K/V in use stays at the
    sinks' block + the window's (+ a chunk), and the kernels' outputs equal the torch backend's."""
    trained = _llm(tiny_llama).engine.config.max_position_embeddings
    n = trained + 100
    prompt = [int(t) for t in torch.randint(4, 90, (n,), generator=torch.Generator().manual_seed(3))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs, peaks = {}, {}
    for backend in ("cpu", "torch"):
        llm = _llm(tiny_llama, kv_policy="streaming", attention_sinks=4, kv_window=32, max_model_len=n + 16,
                   attention_backend=backend)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        outs[backend] = out
        stats, kv = llm.engine.stats(), llm.engine.kv_config
        per_block = kv.block_bytes(0)
        peaks[backend] = stats["kv_cache_bytes_peak"] / per_block  # blocks at once
        assert kv.num_tokens is None  # a sequence of any length fits
        assert kv.blocks_of(0) == kv.groups[0].spec.max_blocks(2, 64)  # the pool is the cap: flat
    # the sinks' block, the window (32 tokens = 2 blocks, +1 straddling), a 64-token chunk (4), slack
    assert peaks["cpu"] <= 1 + 3 + 4 + 2, peaks
    assert outs["cpu"].outputs[0].token_ids == outs["torch"].outputs[0].token_ids
    a = [next(iter(d.values())).logprob for d in outs["cpu"].prompt_logprobs[1:]]
    b = [next(iter(d.values())).logprob for d in outs["torch"].prompt_logprobs[1:]]
    assert len(a) == n - 1
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3


def test_engine_equals_auto_before_anything_is_released(tiny_llama):
    """Shorter than sinks + window, streaming attends to everything: the same tokens as "auto"."""
    prompt = [int(t) for t in torch.randint(4, 90, (20,), generator=torch.Generator().manual_seed(4))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ref = _llm(tiny_llama).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    got = _llm(tiny_llama, kv_policy="streaming", kv_window=32).generate([{"prompt_token_ids": prompt}], params,
                                                                        use_tqdm=False)[0]
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids


def test_fused_step_equals_the_modules(tiny_llama):
    """The C++ step (decodes, a few tokens) takes the policy's window and sinks: bit-identical to the modules."""
    prompt = [int(t) for t in torch.randint(4, 90, (150,), generator=torch.Generator().manual_seed(5))]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = []
    for eager in (False, True):
        llm = _llm(tiny_llama, kv_policy="streaming", attention_sinks=2, kv_window=16, enforce_eager=eager)
        outs.append(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0])
        if not eager:
            assert llm.engine.executor.worker.runner.fused.steps > 50  # the decodes ran fused
    assert outs[0].token_ids == outs[1].token_ids
    assert [next(iter(d.values())).logprob for d in outs[0].logprobs] == \
        [next(iter(d.values())).logprob for d in outs[1].logprobs]


def test_cli_flags_reach_the_engine():
    import argparse

    from turbollm.cli.engine_flags import add_engine_flags, engine_args_from
    from turbollm.core.kv_policy import KVPolicyConfig

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    ns = p.parse_args(["--kv-policy", "streaming", "--kv-window", "64", "--attention-sinks", "2"])
    assert engine_args_from(ns).kv_policy_config() == KVPolicyConfig("streaming", 2, 64)
