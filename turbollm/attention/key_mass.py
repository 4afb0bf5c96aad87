"""Attention mass per cached block: what an attention-score eviction policy ranks blocks by
(`core/kv_eviction.py`).

For each sequence of a step and each of its counted query rows (its last `rows` new tokens), the
softmax attention probabilities of every query head over the keys that row sees are summed per
key, then per block of the sequence's table; `KeyMass.out[i, j]` accumulates, over the layers of
the step, the mass that table entry j of sequence i received. The probabilities are the layer's
own (scale, softcap, causal mask over the compacted table), recomputed from q and the cached K after
the layer's attention has run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from turbollm.attention.metadata import AttentionMetadata

ROW_SLICE = 256  # query rows scored at once (bounds the [heads, rows, keys] probabilities in memory)


@dataclass
class KeyMass:
    """Which rows vote, and where their mass lands."""

    first_rows: list[int]  # per sequence, the first batch row counted (its rows up to the next sequence's)
    out: torch.Tensor  # [B, max table entries] float32, summed over layers, heads and counted rows


def accumulate_key_mass(q: torch.Tensor, k_cache: torch.Tensor, meta: "AttentionMetadata", scale: float,
                        softcap: float | None) -> None:
    """Add this layer's attention mass per table entry to `meta.key_mass.out`. q: [T, Hq, D] (rotated);
    k_cache: [num_blocks, block_size, Hk, D] with the step's K already stored."""
    km = meta.key_mass
    bs, qsl = meta.block_size, meta.query_start_loc
    Hq, D = q.shape[1], q.shape[2]
    Hk = k_cache.shape[2]
    G = Hq // Hk
    for i in range(meta.num_seqs):
        first, end, seq_len = km.first_rows[i], qsl[i + 1], meta.seq_lens[i]
        if first >= end:
            continue
        n_blocks = -(-seq_len // bs)
        k = k_cache.index_select(0, meta.block_tables[i, :n_blocks]).reshape(-1, Hk, D)[:seq_len].float()
        kg = k.permute(1, 2, 0)  # [Hk, D, S]
        mass = torch.zeros(seq_len)
        for r0 in range(first, end, ROW_SLICE):
            r1 = min(end, r0 + ROW_SLICE)
            L = r1 - r0
            x = q[r0:r1].float().permute(1, 0, 2).reshape(Hk, G * L, D)  # heads of a group, then rows
            s = torch.bmm(x, kg) * scale  # [Hk, G*L, S]
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            # row r sees keys up to its own slot: seq_len - (end - r)
            last = torch.arange(seq_len - (end - r0), seq_len - (end - r1)).repeat(G)  # [G*L]
            s.masked_fill_(torch.arange(seq_len).unsqueeze(0) > last.unsqueeze(1), float("-inf"))
            mass += torch.softmax(s, dim=-1).sum(dim=(0, 1))
        padded = torch.zeros(n_blocks * bs)
        padded[:seq_len] = mass
        km.out[i, :n_blocks] += padded.view(n_blocks, bs).sum(1)
