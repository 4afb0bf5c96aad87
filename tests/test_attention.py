"""The batched decode attention against the per-sequence reference, on random paged caches."""

from __future__ import annotations

import pytest
import torch

from conftest import require_kernels
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


def _reference(q, k_cache, v_cache, meta, scale, window, softcap=None):
    outs = []
    for i in range(meta.num_seqs):
        s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        k = gather_kv(k_cache, meta.block_tables[i], meta.seq_lens[i])
        v = gather_kv(v_cache, meta.block_tables[i], meta.seq_lens[i])
        outs.append(attend_one(q[s:e], k, v, scale, meta.seq_lens[i] - (e - s), window, softcap))
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

    kernels = require_kernels()
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Hq,Hk,D,window", [(9, 3, 64, None), (14, 2, 64, None), (12, 2, 128, 300), (4, 1, 256, None)])
def test_cpu_kernel_long_contexts_match_reference(Hq, Hk, D, window, dtype):
    """Contexts spanning several of the kernel's 256-position chunks, at the catalog's head sizes
    (vectorized score, exp and value paths; chunk merging; windows that start mid-chunk)."""
    from turbollm.attention.backend import attend_decode_batch

    kernels = require_kernels()
    lens = [600, 257, 256, 9, 1]
    q, kc, vc, meta = _random_paged(lens, [1] * len(lens), Hq, Hk, D, 16, seed=5)
    kc, vc = kc.to(dtype), vc.to(dtype)  # float16: the reference widens the same stored values
    got = kernels.paged_decode_attention(q.contiguous(), kc, vc, meta.block_tables, torch.tensor(lens), 0.125,
                                         window or -1, 0.0)
    ref = attend_decode_batch(q, kc, vc, meta.block_tables, torch.tensor(lens), 0.125, window, None)
    torch.testing.assert_close(got.reshape(len(lens), -1), ref, rtol=1e-5, atol=1e-5)
    # a sequence's output does not depend on the batch it is in
    alone = kernels.paged_decode_attention(q[:1].contiguous(), kc, vc, meta.block_tables[:1], torch.tensor(lens[:1]),
                                           0.125, window or -1, 0.0)
    assert torch.equal(alone[0], got[0])


def test_cpu_backend_write_kv_matches_reference():
    """The fused C++ K/V store puts strided rows (views of a QKV projection) at the same slots as
    the plain index_copy_ path, and rejects a slot outside the cache."""
    from turbollm.attention.backend import AttentionBackend, CPUKernelAttentionBackend

    require_kernels()
    backend = CPUKernelAttentionBackend()
    g = torch.Generator().manual_seed(6)
    T, Hk, D, nb, bs = 5, 2, 8, 4, 4
    qkv = torch.randn(T, 3 * Hk * D, generator=g)
    k = qkv[:, Hk * D:2 * Hk * D].reshape(T, Hk, D)
    v = qkv[:, 2 * Hk * D:].reshape(T, Hk, D)
    assert not k.is_contiguous()
    slots = torch.tensor([3, 9, 0, 15, 6])
    meta = AttentionMetadata(slots, [0, T], [T], torch.zeros(1, nb, dtype=torch.int64), bs)
    got = [torch.zeros(nb, bs, Hk, D) for _ in range(2)]
    ref = [torch.zeros(nb, bs, Hk, D) for _ in range(2)]
    backend.write_kv(k, v, *got, meta)
    AttentionBackend().write_kv(k, v, *ref, meta)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    half = [torch.zeros(nb, bs, Hk, D, dtype=torch.float16) for _ in range(2)]  # float32 rows into a float16 cache
    backend.write_kv(k * 1e3, v, *half, meta)
    assert torch.equal(half[0].view(-1, Hk, D)[slots], (k * 1e3).to(torch.float16))
    assert torch.equal(half[1].view(-1, Hk, D)[slots], v.to(torch.float16))
    # the vectorized float16 store rounds as Tensor.to does: overflow to inf, subnormals, ties to even
    edge = torch.tensor([1e5, -1e5, 6e-8, -3e-6, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 65504.0, 65520.0, 0.0, -0.0,
                         1e-9, 2.5e-5])
    v2 = edge.repeat(T * Hk * D // len(edge) + 1)[:T * Hk * D].reshape(T, Hk, D)
    backend.write_kv(k, v2, *half, meta)
    assert torch.equal(half[1].view(-1, Hk, D)[slots], v2.to(torch.float16))
    meta.slot_mapping = torch.tensor([3, 9, 0, 16, 6])
    with pytest.raises(RuntimeError, match="out of range"):
        backend.write_kv(k, v, *got, meta)
