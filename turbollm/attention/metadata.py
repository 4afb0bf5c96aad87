"""The attention part of a step's batch: where each new token's K/V goes, and what each sequence sees.

The batch is flat: the new tokens of all sequences are concatenated. Sequence i owns the
rows `query_start_loc[i] : query_start_loc[i+1]`; after this step it has `seq_lens[i]`
tokens in the cache, the last `query_len(i)` of them new. Its cache blocks are
`block_tables[i]`; token t of the batch is written to slot `slot_mapping[t]`
(= block id × block size + offset).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from turbollm.attention.key_mass import KeyMass
from turbollm.attention.kv_quant import RecentMeta


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # [B]: cached + new tokens per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with 0)
    block_size: int
    # The group's KV policy's limits (`KVCacheSpec.attention`): a window that replaces the layers' own
    # (None: each layer's), and the sink positions attended beside it (StreamingLLM; 0: none)
    window: int | None = None
    sinks: int = 0
    # A quantized K/V format's per-sequence ring slots and quantized-part bounds (`attention/kv_quant.py`)
    recent: RecentMeta | None = None
    # An attention-score eviction policy: which rows' attention each layer adds up per block (`key_mass.py`)
    key_mass: KeyMass | None = None
    # Values derived from the fields above that every layer needs (decode index tensors...),
    # computed once per step by the first layer that asks: see `derived`.
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    def derived(self, key: Any, compute: Callable[[], Any]) -> Any:
        """`compute()` on first call for `key` in this step, the same object afterwards."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    @property
    def is_pure_decode(self) -> bool:
        """True when every sequence adds exactly one token (the decode fast path)."""
        return self.query_start_loc[-1] == self.num_seqs

    @property
    def max_query_len(self) -> int:
        """The most new tokens any sequence of the step brings (computed once per step)."""
        qsl = self.query_start_loc
        return self.derived("max_query_len", lambda: max(b - a for a, b in zip(qsl, qsl[1:])))
