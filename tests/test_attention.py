"""The batched decode attention against the per-sequence reference, on random paged caches."""

from __future__ import annotations

import pytest
import torch

from turbollm.attention import AttentionMetadata
from turbollm.attention.backend import TorchAttentionBackend, attend_one, gather_kv


def _random_paged(lens, q_lens, Hq, Hk, D, bs, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks_per = [-(-n // bs) for n in lens]
    nb = sum(blocks_per) + 3
    k_cache = torch.randn(nb, bs, Hk, D, generator=g)
    v_cache = torch.randn(nb, bs, Hk, D, generator=g)
    perm = torch.randperm(nb, generator=g).tolist()  # scattered, non-contiguous blocks
    tables, first = [], 0
    for b in blocks_per:
        tables.append(perm[first:first + b] + [0] * (max(blocks_per) - b))
        first += b
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    q = torch.randn(qsl[-1], Hq, D, generator=g)
    meta = AttentionMetadata(torch.zeros(qsl[-1], dtype=torch.int64), qsl, list(lens), torch.tensor(tables), bs)
    return q, k_cache, v_cache, meta


def _reference(q, k_cache, v_cache, meta, scale, window):
    outs = []
    for i in range(meta.num_seqs):
        s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        k = gather_kv(k_cache, meta.block_tables[i], meta.seq_lens[i])
        v = gather_kv(v_cache, meta.block_tables[i], meta.seq_lens[i])
        outs.append(attend_one(q[s:e], k, v, scale, meta.seq_lens[i] - (e - s), window, None))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("Hq,Hk", [(6, 2), (4, 1), (3, 3)])
def test_decode_batch_matches_reference(window, Hq, Hk):
    lens = [1, 7, 16, 17, 40]
    q, kc, vc, meta = _random_paged(lens, [1] * len(lens), Hq, Hk, 8, 4)
    got = TorchAttentionBackend().forward(q, kc, vc, meta, 0.3, window, None)
    torch.testing.assert_close(got, _reference(q, kc, vc, meta, 0.3, window), rtol=1e-5, atol=1e-6)


def test_mixed_prefill_and_decode_batch():
    lens, q_lens = [9, 30, 12, 5], [1, 6, 1, 5]
    q, kc, vc, meta = _random_paged(lens, q_lens, 4, 2, 8, 4, seed=1)
    got = TorchAttentionBackend().forward(q, kc, vc, meta, 0.25, None, None)
    torch.testing.assert_close(got, _reference(q, kc, vc, meta, 0.25, None), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0)])
@pytest.mark.parametrize("Hq,Hk,D", [(6, 2, 8), (4, 1, 32), (3, 3, 20)])
def test_cpu_kernel_matches_reference(window, softcap, Hq, Hk, D):
    from turbollm.attention.backend import attend_decode_batch
    from turbollm.kernels import get_kernels

    kernels = get_kernels()
    if kernels is None:
        pytest.skip("C++ kernels could not be built here (the reference path is used)")
    lens = [1, 7, 16, 17, 40, 3]
    q, kc, vc, meta = _random_paged(lens, [1] * len(lens), Hq, Hk, D, 4, seed=3)
    got = kernels.paged_decode_attention(q.contiguous(), kc, vc, meta.block_tables, torch.tensor(lens), 0.3,
                                         window or -1, softcap or 0.0)
    ref = attend_decode_batch(q, kc, vc, meta.block_tables, torch.tensor(lens), 0.3, window, softcap)
    torch.testing.assert_close(got.reshape(len(lens), -1), ref, rtol=1e-5, atol=1e-5)


def test_cpu_backend_mixed_batch_matches_reference():
    from turbollm.attention.backend import CPUKernelAttentionBackend

    lens, q_lens = [9, 30, 12, 5, 21], [1, 6, 1, 5, 1]
    q, kc, vc, meta = _random_paged(lens, q_lens, 4, 2, 16, 4, seed=4)
    got = CPUKernelAttentionBackend().forward(q, kc, vc, meta, 0.25, 7, None)
    torch.testing.assert_close(got, _reference(q, kc, vc, meta, 0.25, 7), rtol=1e-5, atol=1e-5)
