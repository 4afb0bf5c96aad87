"""Attention backends: the interface and the plain PyTorch CPU implementation.

GQA/MQA is computed by head grouping: queries are viewed as `[kv_heads, group, L, D]` and
multiplied against `[kv_heads, 1, S, D]` keys, so K/V are never repeated per query head.
A sliding-window layer lets token i see keys j with `i - window < j <= i`.
"""

from __future__ import annotations

from typing import Callable

import torch

from turbollm.attention.key_mass import accumulate_key_mass
from turbollm.attention.kv_quant import gather_reference, write_reference
from turbollm.attention.kv_storage import LayerKVCache
from turbollm.attention.metadata import AttentionMetadata
from turbollm.kernels.limits import SMALL_QUERY_MAX

ATTENTION_BACKENDS: dict[str, type["AttentionBackend"]] = {}


def register_backend(name: str) -> Callable[[type["AttentionBackend"]], type["AttentionBackend"]]:
    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        ATTENTION_BACKENDS[name] = cls
        return cls

    return deco


class AttentionBackend:
    """Writes new K/V into the paged cache and attends over each sequence's blocks."""

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """k, v: [T, Hk, D]; caches: [num_blocks, block_size, Hk, D]."""
        kc = k_cache.view(-1, *k_cache.shape[2:])
        vc = v_cache.view(-1, *v_cache.shape[2:])
        kc.index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, meta.slot_mapping, v.to(vc.dtype))

    def write_kv_quant(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata) -> None:
        """A quantized format: the blocks leaving the recent window quantized, the newest tokens to the ring."""
        write_reference(k, v, cache, meta.block_tables, meta.query_start_loc, meta.recent)

    def forward_quant(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float,
                      window: int | None, softcap: float | None) -> torch.Tensor:
        """Attention over a quantized format (the reference: each sequence's K/V dequantized, then `attend_one`)."""
        qsl, rec = meta.query_start_loc, meta.recent
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        small = meta.max_query_len <= SMALL_QUERY_MAX
        for i in range(meta.num_seqs):
            start, end, seq_len = qsl[i], qsl[i + 1], meta.seq_lens[i]
            if small:  # each row as a decode of its position, reading the ring from its own bound
                for r in range(start, end):
                    n = seq_len - (end - 1 - r)
                    k, v = gather_reference(cache, meta.block_tables[i], rec.slots[i], rec.row_qlo[r], n)
                    out[r:r + 1] = attend_one(q[r:r + 1], k, v, scale, n - 1, window, softcap)
                continue
            k, v = gather_reference(cache, meta.block_tables[i], rec.slots[i], rec.qlo_new[i], seq_len)
            out[start:end] = attend_one(q[start:end], k, v, scale, seq_len - (end - start), window, softcap)
        return out

    def key_mass(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 softcap: float | None) -> None:
        """An eviction policy's scores: add this layer's attention mass per table entry to `meta.key_mass`."""
        accumulate_key_mass(q, k_cache, meta, scale, softcap)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None, softcap: float | None, sinks: int = 0,
                q_sink: torch.Tensor | None = None) -> torch.Tensor:
        """With `sinks` (and a window), token p also sees positions j < sinks older than its window,
        scored with `q_sink` (its query rotated to the sinks' position) in the same softmax."""
        raise NotImplementedError


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` cached tokens of one sequence: [seq_len, Hk, D]."""
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:n_blocks])
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, context_len: int,
               window: int | None, softcap: float | None, sinks: int = 0,
               q_sink: torch.Tensor | None = None) -> torch.Tensor:
    """Reference attention of one sequence by head grouping.

    q: [L, Hq, D] (the new tokens, at positions context_len .. context_len+L-1);
    k, v: [S, Hk, D] with S = context_len + L. Returns [L, Hq * D]. With `sinks`, positions j < sinks
    older than a token's window are scored with its row of `q_sink` [L, Hq, D].
    """
    L, Hq, D = q.shape
    S, Hk, _ = k.shape
    G = Hq // Hk
    kg = k.float().permute(1, 0, 2).unsqueeze(1)  # [Hk, 1, S, D]
    vg = v.float().permute(1, 0, 2).unsqueeze(1)

    def score(x: torch.Tensor) -> torch.Tensor:
        s = torch.matmul(x.float().permute(1, 0, 2).reshape(Hk, G, L, D), kg.transpose(-1, -2)) * scale
        return torch.tanh(s / softcap) * softcap if softcap else s  # [Hk, G, L, S]

    scores = score(q)
    qpos = torch.arange(context_len, context_len + L).unsqueeze(1)
    kpos = torch.arange(S).unsqueeze(0)
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    if sinks and window is not None:
        sink = (kpos < sinks) & (kpos <= qpos - window)
        scores = torch.where(sink, score(q_sink), scores)
        allowed |= sink
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vg)  # [Hk, G, L, D]
    return out.reshape(Hq, L, D).permute(1, 0, 2).reshape(L, Hq * D).to(q.dtype)


def attend_decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """One new token for each of B sequences, in one batched product.

    q: [B, Hq, D]; block_tables: [B, W]; seq_lens: [B] (the new token included). Keys are
    gathered to [B, W*block_size] and positions past each sequence's length are masked.
    Returns [B, Hq * D].
    """
    B, Hq, D = q.shape
    bs, Hk = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hk
    max_len = int(seq_lens.max())
    width = -(-max_len // bs)
    tables = block_tables[:, :width]
    k = k_cache[tables].reshape(B, width * bs, Hk, D)[:, :max_len].permute(0, 2, 1, 3)  # [B, Hk, S, D]
    v = v_cache[tables].reshape(B, width * bs, Hk, D)[:, :max_len].permute(0, 2, 1, 3)
    qg = q.float().reshape(B, Hk, G, D)
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # [B, Hk, G, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    kpos = torch.arange(max_len).unsqueeze(0)  # [1, S]
    last = (seq_lens - 1).unsqueeze(1)  # position of the new token
    allowed = kpos <= last
    if window is not None:
        allowed &= kpos > last - window
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float())  # [B, Hk, G, D]
    return out.reshape(B, Hq * D).to(q.dtype)


def decode_groups(meta: AttentionMetadata) -> list[list[int]]:
    """Decoding sequences (one new token) grouped by length class, for batched attention.

    A group pads every sequence to its longest, so lengths are grouped by powers of two:
    padding at most doubles the keys read. Groups of one are left to the per-sequence path.
    """
    qsl = meta.query_start_loc
    classes: dict[int, list[int]] = {}
    for i in range(meta.num_seqs):
        if qsl[i + 1] - qsl[i] == 1:
            classes.setdefault(max(meta.seq_lens[i] - 1, 1).bit_length(), []).append(i)
    return [g for g in classes.values() if len(g) > 1]


def _decode_index(meta: AttentionMetadata, seqs: list[int]) -> tuple[torch.Tensor, ...]:
    """For decoding sequences `seqs`: their indices, their query rows in the batch, their lengths."""
    qsl = meta.query_start_loc
    idx = torch.tensor(seqs)
    return idx, torch.tensor([qsl[i] for i in seqs]), torch.tensor([meta.seq_lens[i] for i in seqs])


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] as the kernels read it: each row's H * D values contiguous (rows may be strided)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Plain PyTorch attention over the paged cache (the reference of the `cpu` backend).

    Sequences that add one token (decodes) are attended together in one batched product;
    sequences that add several (prefill chunks) one at a time.
    """

    use_kernels = False

    def __init__(self) -> None:
        self.kernels = None
        if self.use_kernels:
            from turbollm.kernels import get_kernels

            self.kernels = get_kernels()

    def forward(self, q, k_cache, v_cache, meta, scale, window, softcap, sinks=0, q_sink=None):
        qsl = meta.query_start_loc
        if sinks and (window is None or q_sink is None or q_sink.shape != q.shape):
            raise ValueError("attention sinks need a window and q_sink shaped like q")
        if self.kernels is not None and q.dtype == torch.float32:
            lens = meta.derived("decode_lens", lambda: torch.tensor(meta.seq_lens))
            extra = (sinks, _rows_contiguous(q_sink)) if sinks else ()
            if meta.is_pure_decode:  # row i of q is sequence i (the kernel reads strided q)
                res = self.kernels.paged_decode_attention(_rows_contiguous(q), k_cache, v_cache, meta.block_tables,
                                                          lens, scale, window or -1, softcap or 0.0, None, *extra)
            else:
                starts = meta.derived("query_start_loc", lambda: torch.tensor(qsl))
                if meta.max_query_len <= self.kernels.small_query_max:
                    # a few new tokens per sequence (a prompt's tail, verification): one decode per token,
                    # so each row's output is the one it has alone (row invariance)
                    res = self.kernels.paged_decode_attention(_rows_contiguous(q), k_cache, v_cache,
                                                              meta.block_tables, lens, scale, window or -1,
                                                              softcap or 0.0, starts, *extra)
                else:  # prefill chunks and mixes with them: the tiled kernel, one call for the whole step
                    res = self.kernels.paged_attention(_rows_contiguous(q), k_cache, v_cache, meta.block_tables,
                                                       starts, lens, scale, window or -1, softcap or 0.0, *extra)
            return res.reshape(q.shape[0], -1)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        done: set[int] = set()
        for group in ([] if sinks else decode_groups(meta)):
            idx, rows, lens = _decode_index(meta, group)
            out[rows] = attend_decode_batch(q[rows], k_cache, v_cache, meta.block_tables[idx], lens, scale, window,
                                            softcap)
            done.update(group)
        for i in range(meta.num_seqs):
            if i in done:
                continue
            start, end = qsl[i], qsl[i + 1]
            seq_len = meta.seq_lens[i]
            k = gather_kv(k_cache, meta.block_tables[i], seq_len)
            v = gather_kv(v_cache, meta.block_tables[i], seq_len)
            out[start:end] = attend_one(q[start:end], k, v, scale, seq_len - (end - start), window, softcap, sinks,
                                        q_sink[start:end] if sinks else None)
        return out


@register_backend("cpu")
class CPUKernelAttentionBackend(TorchAttentionBackend):
    """The torch backend with attention in our C++ kernels, reading the blocks in place (no gather):
    `paged_decode_attention` for steps where every sequence adds at most `small_query_max` (8) tokens
    (one decode per new token, so a row's output never depends on the rows beside it), `paged_attention`
    (tiled over keys with an online softmax, any number of new tokens per sequence) for every other step.

    Falls back to the pure-PyTorch path when the kernel cannot be compiled.
    """

    use_kernels = True

    def write_kv_quant(self, k, v, cache, meta):
        if self.kernels is None or k.dtype != torch.float32:
            return super().write_kv_quant(k, v, cache, meta)
        t = meta.derived("recent_tensors", lambda: recent_tensors(meta))
        self.kernels.paged_write_kv_quant(_rows_contiguous(k), _rows_contiguous(v), cache.k, cache.v, cache.k_scale,
                                          cache.v_scale, cache.k_recent, cache.v_recent, meta.block_tables,
                                          t["qsl"], t["slots"], t["first"], t["old"], t["new"],
                                          cache.layout.ring_blocks, cache.layout.quant_bits)

    def forward_quant(self, q, cache, meta, scale, window, softcap):
        if self.kernels is None or q.dtype != torch.float32:
            return super().forward_quant(q, cache, meta, scale, window, softcap)
        t = meta.derived("recent_tensors", lambda: recent_tensors(meta))
        kv = [cache.k, cache.v, cache.k_scale, cache.v_scale, cache.k_recent, cache.v_recent]
        lens = meta.derived("decode_lens", lambda: torch.tensor(meta.seq_lens))
        args = (cache.layout.ring_blocks, cache.layout.quant_bits, scale, window or -1, softcap or 0.0)
        if meta.max_query_len <= self.kernels.small_query_max:  # decodes, a few tokens: one decode per token
            res = self.kernels.paged_decode_attention_quant(_rows_contiguous(q), kv, meta.block_tables, lens,
                                                            t["slots"], t["read"], *args,
                                                            None if meta.is_pure_decode else t["qsl"])
        else:
            res = self.kernels.paged_attention_quant(_rows_contiguous(q), kv, meta.block_tables, t["qsl"], lens,
                                                     t["slots"], t["new"], *args)
        return res.reshape(q.shape[0], -1)

    def key_mass(self, q, k_cache, meta, scale, softcap):
        if self.kernels is None or q.dtype != torch.float32 or k_cache.dtype not in (torch.float32, torch.float16):
            return super().key_mass(q, k_cache, meta, scale, softcap)
        km = meta.key_mass
        t = meta.derived("key_mass_tensors", lambda: (torch.tensor(meta.query_start_loc), torch.tensor(meta.seq_lens),
                                                      torch.tensor(km.first_rows)))
        self.kernels.paged_key_mass(_rows_contiguous(q), k_cache, meta.block_tables, *t, scale, softcap or 0.0, km.out)

    def write_kv(self, k, v, k_cache, v_cache, meta):
        same = k.dtype == k_cache.dtype or (k.dtype == torch.float32 and k_cache.dtype == torch.float16)
        if self.kernels is None or not same or v.dtype != k.dtype or v_cache.dtype != k_cache.dtype:
            return super().write_kv(k, v, k_cache, v_cache, meta)
        self.kernels.paged_write_kv(_rows_contiguous(k), _rows_contiguous(v), k_cache, v_cache, meta.slot_mapping)


def recent_tensors(meta: AttentionMetadata) -> dict[str, torch.Tensor]:
    """A quantized format's per-sequence step data as the kernels take it (built once per step and group)."""
    rec = meta.recent
    return {"qsl": torch.tensor(meta.query_start_loc), "slots": torch.tensor(rec.slots),
            "first": torch.tensor(rec.first_pos), "old": torch.tensor(rec.qlo_old), "new": torch.tensor(rec.qlo_new),
            "read": torch.tensor(rec.row_qlo)}


def get_attention_backend(name: str = "cpu") -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]()
