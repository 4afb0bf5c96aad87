"""Quantized K/V (kv_cache_dtype int8 / int4): the plain PyTorch reference of the store and the read.

The layout is `attention/kv_storage.py`'s. Writing a step's new tokens (`write_reference`), per
sequence: the blocks that are now complete and older than its last `recent_window` tokens — their
tokens taken from the sequence's float16 ring (computed earlier) or from this step's new rows — are
quantized into their pool blocks (K per channel over the block's tokens, V per token), then the new
tokens still in the recent window go to the ring. `RecentMeta` says, per sequence, where the
quantized part ends before (`qlo_old`) and after (`qlo_new`) the step: block-aligned positions;
positions below `qlo_new` are read from the pool, the rest from the ring (`gather_reference`).

The formats' own quantization (int8 symmetric, int4 asymmetric packed) is theirs: attention/kv_formats.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turbollm.attention.kv_storage import LayerKVCache


@dataclass
class RecentMeta:
    """Per sequence of a step: its slot's ring, its first new position, the end of its quantized part
    before and after the step (block-aligned); and per row of the step (`row_qlo`), where the row reads
    the ring from in a small-query step: max(ring floor, (p + 1 - recent_window) rounded down to a block)
    — what a one-token decode of position p reads, whatever came in the same step (row invariance, so
    speculative verification stays exact). Steps with longer runs read from qlo_new."""

    slots: list[int]
    first_pos: list[int]
    qlo_old: list[int]
    qlo_new: list[int]
    row_qlo: list[int]


def ring_block(cache: LayerKVCache, slot: int, block_index: int) -> int:
    """The ring block holding a sequence's block `block_index` (positions block_index * bs ..)."""
    m = cache.layout.ring_blocks
    return slot * m + block_index % m


def ring_rows(cache: LayerKVCache, slot: int, positions: range) -> torch.Tensor:
    """Rows of the flattened ring [slots * ring_blocks * bs, Hk, D] holding a sequence's `positions`."""
    bs = cache.layout.block_size
    return torch.tensor([ring_block(cache, slot, p // bs) * bs + p % bs for p in positions], dtype=torch.int64)


def write_reference(k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, block_tables: torch.Tensor,
                    query_start_loc: list[int], recent: RecentMeta) -> None:
    """Store a step's new K/V rows [T, Hk, D] (sequence i's are rows qsl[i]:qsl[i+1], at positions
    first_pos[i] ..): quantize the blocks between qlo_old and qlo_new, put the newer tokens in the ring."""
    lay = cache.layout
    bs, fmt, tail = lay.block_size, lay.format, lay.block_shape[1:]
    rk, rv = cache.k_recent.view(-1, *tail), cache.v_recent.view(-1, *tail)
    for i, slot in enumerate(recent.slots):
        rows = slice(query_start_loc[i], query_start_loc[i + 1])
        kn, vn, c = k[rows], v[rows], recent.first_pos[i]
        lo, hi = recent.qlo_old[i], recent.qlo_new[i]
        if hi > lo:  # positions lo .. hi - 1: those before c from the ring, the rest new
            old, fresh = ring_rows(cache, slot, range(lo, min(c, hi))), slice(max(0, lo - c), max(0, hi - c))
            kb = torch.cat([rk[old].float(), kn[fresh].float()]).view(-1, bs, *tail)
            vb = torch.cat([rv[old].float(), vn[fresh].float()]).view(-1, bs, *tail)
            blocks = block_tables[i, lo // bs:hi // bs]
            kq, ks = fmt.quantize_k(kb)
            vq, vs = fmt.quantize_v(vb)
            cache.k[blocks], cache.k_scale[blocks], cache.v[blocks], cache.v_scale[blocks] = kq, ks, vq, vs
        start = max(c, hi)
        new = ring_rows(cache, slot, range(start, c + kn.shape[0]))
        rk[new] = kn[start - c:].half()
        rv[new] = vn[start - c:].half()


def gather_reference(cache: LayerKVCache, table: torch.Tensor, slot: int, qlo: int,
                     seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first `seq_len` tokens' K and V as float32 [seq_len, Hk, D]: dequantized from its pool
    blocks below `qlo`, from its ring above."""
    lay = cache.layout
    bs = lay.block_size
    nq = qlo // bs
    blocks = table[:nq]
    k = lay.format.dequantize_k(cache.k[blocks], cache.k_scale[blocks]).reshape(-1, *lay.block_shape[1:])
    v = lay.format.dequantize_v(cache.v[blocks], cache.v_scale[blocks]).reshape(-1, *lay.block_shape[1:])
    rk, rv = [k], [v]
    for j in range(nq, -(-seq_len // bs)):
        r = ring_block(cache, slot, j)
        rk.append(cache.k_recent[r].float())
        rv.append(cache.v_recent[r].float())
    return torch.cat(rk)[:seq_len], torch.cat(rv)[:seq_len]
