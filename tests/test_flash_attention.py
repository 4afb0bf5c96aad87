"""The any-query paged attention kernel (kernels/csrc/flash_attention.cpp) against the plain PyTorch
attention: prefill chunks over cached prefixes, verification-sized steps, decodes and mixes of
them in one batch, on odd shapes (head dims not a multiple of 8 or 32, GQA 1:1 to 7:1, MQA, block
sizes that do not divide the lengths), with sliding windows, soft-capping and float16 K/V; split
and unsplit tasks; and the backend using it for every step that is not a pure decode."""

from __future__ import annotations

import pytest
import torch

from conftest import require_kernels
from test_attention import _random_paged, _reference
from turbollm.attention.backend import CPUKernelAttentionBackend


def _run(kernels, q, kc, vc, meta, scale, window, softcap):
    out = kernels.paged_attention(q, kc, vc, meta.block_tables, torch.tensor(meta.query_start_loc),
                                  torch.tensor(meta.seq_lens), scale, window or -1, softcap or 0.0)
    return out.reshape(q.shape[0], -1)


CASES = [  # (lens, new tokens per sequence)
    ([40], [40]),  # a whole prompt
    ([300], [37]),  # a chunk over a cached prefix (several query tiles, keys in several steps)
    ([129, 70], [5, 8]),  # verification-sized steps
    ([9, 30, 12, 5, 64], [1, 6, 1, 5, 17]),  # decodes and chunks mixed
    ([1000], [3]),  # few tasks: split over the keys
]


@pytest.mark.parametrize("lens,q_lens", CASES)
@pytest.mark.parametrize("Hq,Hk,D,bs", [(4, 2, 64, 16), (7, 1, 40, 5), (3, 3, 20, 16), (14, 2, 72, 7)])
def test_matches_reference(lens, q_lens, Hq, Hk, D, bs):
    kernels = require_kernels()
    q, kc, vc, meta = _random_paged(lens, q_lens, Hq, Hk, D, bs, seed=len(lens) + D)
    got = _run(kernels, q, kc, vc, meta, D ** -0.5, None, None)
    torch.testing.assert_close(got, _reference(q, kc, vc, meta, D ** -0.5, None), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("window,softcap", [(5, None), (33, None), (None, 20.0), (100, 30.0)])
@pytest.mark.parametrize("lens,q_lens", CASES[1:4])
def test_windows_and_softcap(lens, q_lens, window, softcap):
    kernels = require_kernels()
    q, kc, vc, meta = _random_paged(lens, q_lens, 6, 2, 32, 16, seed=7)
    q = q * 4  # large scores: the cap and the running max both matter
    got = _run(kernels, q, kc, vc, meta, 0.2, window, softcap)
    ref = _reference(q, kc, vc, meta, 0.2, window, softcap)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # float tanh / exp against torch's: ~3e-6


def test_float16_cache_and_strided_queries():
    kernels = require_kernels()
    q, kc, vc, meta = _random_paged([77, 20], [77, 4], 8, 2, 64, 16, seed=3)
    kc, vc = kc.half(), vc.half()
    qkv = torch.cat([q.reshape(q.shape[0], -1), torch.randn(q.shape[0], 256)], dim=1)  # q as a view of QKV
    qv = qkv[:, :q.numel() // q.shape[0]].view(q.shape[0], 8, 64)
    assert not qv.is_contiguous()
    got = _run(kernels, qv, kc, vc, meta, 0.125, None, None)
    torch.testing.assert_close(got, _reference(q, kc, vc, meta, 0.125, None), rtol=1e-5, atol=2e-6)


def _forms() -> list[str]:
    """The key step's forms this CPU runs (attention_tile.h): portable and avx2 everywhere the kernels
    build on x86-64, avx512 where the CPU has AVX-512 F."""
    from turbollm.kernels import cpu_flags

    return ["portable", "avx2"] + (["avx512"] if "avx512f" in cpu_flags().split() else [])


@pytest.mark.parametrize("lens,q_lens,window,softcap,half", [
    ([40], [40], None, None, False), ([300], [37], 33, 20.0, False), ([9, 30, 12, 5, 64], [1, 6, 1, 5, 17], None, None,
                                                                           True), ([1000], [3], 100, None, True)])
@pytest.mark.parametrize("Hq,Hk,D", [(9, 3, 64), (7, 1, 40), (12, 2, 128), (3, 3, 20)])
def test_forms_give_the_same_bits(lens, q_lens, window, softcap, half, Hq, Hk, D):
    """Every form of the key step this CPU runs (portable, AVX2, AVX-512: rows in lanes, one fma chain per
    output) gives every output the same bits, each also against the reference; 'auto' takes the widest."""
    kernels = require_kernels()
    q, kc, vc, meta = _random_paged(lens, q_lens, Hq, Hk, D, 16, seed=D + len(lens))
    q = q * 4 if softcap else q
    if half:
        kc, vc = kc.half(), vc.half()
    ref = _reference(q, kc.float(), vc.float(), meta, D ** -0.5, window, softcap)
    forms = _forms()
    got = {}
    try:
        for form in forms:
            kernels.set_attention_isa(form)
            got[form] = _run(kernels, q, kc, vc, meta, D ** -0.5, window, softcap)
            torch.testing.assert_close(got[form], ref, rtol=1e-5, atol=1e-5 if softcap else 2e-6)
    finally:
        assert kernels.set_attention_isa("auto") == forms[-1]
    for form in forms[1:]:
        assert torch.equal(got[form], got["portable"]), form
    assert torch.equal(_run(kernels, q, kc, vc, meta, D ** -0.5, window, softcap), got[forms[-1]])


def test_forms_refused_by_name():
    kernels = require_kernels()
    with pytest.raises(RuntimeError, match="'auto', 'portable', 'avx2' or 'avx512'"):
        kernels.set_attention_isa("avx1024")
    if "avx512" not in _forms():
        with pytest.raises(RuntimeError, match="does not run the avx512 form"):
            kernels.set_attention_isa("avx512")


def test_one_thread_equals_two():
    """The split over keys depends on the thread count; the result may not (beyond rounding)."""
    kernels = require_kernels()
    q, kc, vc, meta = _random_paged([2000], [5], 4, 1, 64, 16, seed=9)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(kernels, q, kc, vc, meta, 0.125, None, None)
        torch.set_num_threads(2)
        two = _run(kernels, q, kc, vc, meta, 0.125, None, None)
    finally:
        torch.set_num_threads(n)
    torch.testing.assert_close(one, two, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(two, _reference(q, kc, vc, meta, 0.125, None), rtol=1e-5, atol=2e-6)


def test_backend_uses_it_for_prefill_and_mixed_steps(monkeypatch):
    """The C++ backend sends every step with more than 8 new tokens in a sequence to the kernel, in one call."""
    backend = CPUKernelAttentionBackend()
    if backend.kernels is None:
        require_kernels()
    calls = []
    real = backend.kernels

    class Spy:
        def __getattr__(self, name):
            if name == "paged_attention":
                return lambda *a: calls.append(a) or real.paged_attention(*a)
            return getattr(real, name)

    monkeypatch.setattr(backend, "kernels", Spy())
    q, kc, vc, meta = _random_paged([9, 30, 12], [1, 6, 12], 4, 2, 32, 16, seed=2)
    got = backend.forward(q, kc, vc, meta, 0.25, None, None)
    assert len(calls) == 1
    torch.testing.assert_close(got, _reference(q, kc, vc, meta, 0.25, None), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("lens,q_lens", [([300], [5]), ([129, 70, 9], [8, 1, 3]), ([600, 257], [2, 8])])
@pytest.mark.parametrize("window,softcap,half", [(None, None, False), (100, 30.0, False), (None, None, True)])
def test_small_query_steps_are_one_decode_per_token(lens, q_lens, window, softcap, half):
    """Steps where no sequence brings more than `small_query_max` tokens: the decode kernel with
    query_start_loc attends each new token as a decode of its own position, bit for bit (row
    invariance: a verification row equals the same token decoded alone), and the backend takes it."""
    kernels = require_kernels()
    q, kc, vc, meta = _random_paged(lens, q_lens, 6, 2, 32, 16, seed=sum(lens))
    if half:
        kc, vc = kc.half(), vc.half()
    w, cap = window or -1, softcap or 0.0
    got = kernels.paged_decode_attention(q, kc, vc, meta.block_tables, torch.tensor(meta.seq_lens), 0.2, w, cap,
                                         torch.tensor(meta.query_start_loc)).reshape(q.shape[0], -1)
    for s, (n, length) in enumerate(zip(q_lens, lens)):
        for j in range(n):
            row = meta.query_start_loc[s] + j
            alone = kernels.paged_decode_attention(q[row:row + 1].contiguous(), kc, vc, meta.block_tables[s:s + 1],
                                                   torch.tensor([length - (n - 1 - j)]), 0.2, w, cap)
            assert torch.equal(got[row], alone.reshape(-1)), (s, j)
    ref = _reference(q, kc.float(), vc.float(), meta, 0.2, window, softcap)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    backend = CPUKernelAttentionBackend()
    assert backend.kernels.small_query_max == 8
    via_backend = backend.forward(q, kc, vc, meta, 0.2, window, softcap)
    assert torch.equal(via_backend, got)


def test_decode_kernel_refuses_long_query_runs():
    kernels = require_kernels()
    q, kc, vc, meta = _random_paged([40], [9], 4, 2, 32, 16, seed=1)
    with pytest.raises(RuntimeError, match="9 new tokens"):  # more than small_query_max: the tiled kernel's
        kernels.paged_decode_attention(q, kc, vc, meta.block_tables, torch.tensor(meta.seq_lens), 0.2, -1, 0.0,
                                       torch.tensor(meta.query_start_loc))
