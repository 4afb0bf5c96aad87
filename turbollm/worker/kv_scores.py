"""The worker's side of attention-score eviction, one object (the scheduler's is core/kv_eviction.py `Evictor`).

`AttentionScores` asks the attention kernels for the mass each table entry's keys receive from each sequence's
last `score_rows` query rows of a step (`KeyMass`, attention/key_mass.py, on every group's metadata), sums it
over the tensor-parallel ranks (each scored its own heads), returns it per sequence in
`ModelRunnerOutput.kv_scores`, and applies the table positions the scheduler side removed
(`CachedRequestData.evicted_positions`) to a sequence's state before its next step.
"""

from __future__ import annotations

import torch

from turbollm.attention.key_mass import KeyMass
from turbollm.distributed import get_tp
from turbollm.handoff.runner_output import ModelRunnerOutput
from turbollm.handoff.scheduler_output import SchedulerOutput


class AttentionScores:
    def __init__(self, score_rows: int):
        self.score_rows = score_rows  # each sequence's last rows of a step whose attention is scored

    def first_scored_row(self, row_start: int, num_rows: int) -> int:
        """The first of a sequence's rows (they start at `row_start`) whose attention counts."""
        return row_start + max(0, num_rows - self.score_rows)

    @staticmethod
    def key_mass(first_rows: list[int], num_seqs: int, max_entries: int) -> KeyMass:
        return KeyMass(first_rows, torch.zeros(num_seqs, max_entries))

    @staticmethod
    def collect(sched: SchedulerOutput, km: KeyMass, qsl, states: dict, out: ModelRunnerOutput) -> None:
        """Each sequence's (rows counted, attention mass per table entry) of this step, into `out`."""
        if get_tp().tp_size > 1:  # each rank scored its own heads: the sum is every head's
            from turbollm.distributed.tensor_parallel import all_reduce

            all_reduce(km.out)
        for i, sid in enumerate(sched.scheduled_token_ids):
            out.kv_scores[sid] = (qsl[i + 1] - km.first_rows[i], km.out[i, :len(states[sid].block_ids[0])].tolist())

    @staticmethod
    def remove(st, positions: list[int]) -> None:
        """Delete the table positions the scheduler side evicted (in its order; before new blocks are added)."""
        for pos in positions:
            for ids in st.block_ids:
                del ids[pos]
        st.evicted_blocks += len(positions)
