"""The worker's side of a quantized K/V format's recent window (`attention/kv_quant.py`).

Each sequence with state on the worker holds one ring slot (float16 blocks of its newest tokens, in
every layer), `kv_qlo`, the block-aligned position below which its K/V are quantized in the pool,
and `ring_floor`, below which the ring holds nothing of it (a prefix hit's start, or the end of a
long chunk quantized as written). Per step, `RecentRings.meta` gives every sequence's slot and its
quantized part before and after the step: after it, every block that is complete and older than
the last `recent_window` tokens of what the step computes. A block may so be quantized while the
ring still holds it: a row of a small-query step reads the ring from its own bound (`row_qlo`), as a
one-token decode of its position would, so verification rows equal plain decodes. A draft token is
never quantized (the window is longer than the drafts: `EngineArgs` checks), nor is a block a
sliding window has released (it is never read).
The scheduler side gives each sequence its slot (`NewRequestData.ring_slot`, a resumed one's in
`CachedRequestData`, a sibling's in `ForkData`): the slot's blocks are pool blocks it took out of the pool
for as long as the sequence runs (`attention/kv_storage.py`: the rings are a view of the pool's storage).
"""

from __future__ import annotations

from turbollm.attention.kv_quant import RecentMeta
from turbollm.attention.kv_storage import LayerKVCache
from turbollm.handoff.scheduler_output import NULL_BLOCK


class RecentRings:
    def __init__(self, kv_caches: list[LayerKVCache], layer_groups: list[int]):
        self.kv_caches = [c for c in kv_caches if c is not None]  # a pipeline stage holds its layers' only
        lay = next(c.layout for c in self.kv_caches)
        self.window, self.block_size = lay.recent_window, lay.block_size
        self.group_first_layer = [layer_groups.index(g) for g in range(max(layer_groups) + 1)]

    def take(self, st, slot: int) -> None:
        """Sequence state `st` writes its tokens from position st.num_computed_tokens on into ring `slot`."""
        if slot < 0:
            raise RuntimeError(f"internal error: sequence {st.seq_id} came without a ring slot for its recent tokens")
        st.ring_slot = slot
        st.kv_qlo = st.ring_floor = st.num_computed_tokens

    @staticmethod
    def give_back(st) -> None:
        st.ring_slot = -1

    def fork(self, parent, child, slot: int) -> None:
        """A sibling forked off `parent` into ring `slot`: a copy of the parent's ring."""
        self.take(child, slot)
        child.kv_qlo, child.ring_floor = parent.kv_qlo, parent.ring_floor
        for cache in self.kv_caches:
            cache.copy_ring(parent.ring_slot, child.ring_slot)

    def meta(self, states: list, new_tokens: list[int]) -> list[RecentMeta]:
        """Per KV-cache group, the step's `RecentMeta` for `states` (in batch order) computing `new_tokens`
        each; advances every state's kv_qlo."""
        bs, R = self.block_size, self.window
        slots, first, old, new, rows = [], [], [], [], []
        for st, n in zip(states, new_tokens):
            c = st.num_computed_tokens
            qlo = max(st.kv_qlo, (c + n - R) // bs * bs)
            if qlo > c:  # new tokens quantized as written (a long chunk): never in the ring
                st.ring_floor = max(st.ring_floor, qlo)
            slots.append(st.ring_slot)
            first.append(c)
            old.append(st.kv_qlo)
            new.append(qlo)
            rows += [max(st.ring_floor, (p + 1 - R) // bs * bs) for p in range(c, c + n)]
            st.kv_qlo = qlo
        out = []
        for g in range(len(self.group_first_layer)):  # released blocks (a sliding window's) are not quantized
            starts = [max(lo, _first_held(st.block_ids[g], lo // bs, hi // bs) * bs)
                      for st, lo, hi in zip(states, old, new)]
            out.append(RecentMeta(slots, first, starts, new, rows))
        return out


def _first_held(table: list[int], lo: int, hi: int) -> int:
    """The first block index in lo .. hi - 1 whose entry is not released (hi if none)."""
    for j in range(lo, hi):
        if table[j] != NULL_BLOCK:
            return j
    return hi
