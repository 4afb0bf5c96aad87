"""The model runner: turns a SchedulerOutput into one ForwardBatch, runs the model, returns logits.

It flattens the scheduled tokens of all sequences, computes their positions and KV slots
from each block table, and asks the model for the logits of the rows that are sampled
(the last new token of each sequence that is up to date) and, for requests that want
prompt logprobs, of every prompt row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turbollm.attention import AttentionBackend, AttentionMetadata
from turbollm.engine.scheduler import SchedulerOutput
from turbollm.models.common import CausalLM
from turbollm.models import decode_step
from turbollm.models.forward_batch import ForwardBatch


@dataclass
class RunnerOutput:
    """Logits of the rows asked for: `sample_logits[i]` belongs to `sample_seqs[i]`."""

    sample_logits: torch.Tensor  # [num sampled, vocab]
    sample_index: list[int]  # index into SchedulerOutput.scheduled of each sampled row
    prompt_logits: dict[int, tuple[int, torch.Tensor]]  # scheduled index → (first position, [n, vocab])


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 backend: AttentionBackend, fused_decode: bool = True):
        self.model, self.kv_caches, self.block_size, self.backend = model, kv_caches, block_size, backend
        self.fused_decode = fused_decode  # pure-decode steps may run their layers in one C++ call
        decode_step.reset(model.model)  # a step built for another runner holds that runner's K/V

    def prepare(self, sched: SchedulerOutput) -> ForwardBatch:
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        bs = self.block_size
        for s in sched.scheduled:
            seq, c, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            tokens = seq.all_token_ids
            ids.extend(tokens[c:c + n])
            pos.extend(range(c, c + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
        width = max(len(s.seq.block_table) for s in sched.scheduled)
        tables = torch.zeros(len(sched.scheduled), width, dtype=torch.int64)
        for i, s in enumerate(sched.scheduled):
            tables[i, :len(s.seq.block_table)] = torch.tensor(s.seq.block_table, dtype=torch.int64)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64), qsl, seq_lens, tables, bs)
        return ForwardBatch(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta,
                            self.kv_caches, self.backend, max_position=max(seq_lens) - 1,
                            fused_decode=self.fused_decode)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate the K/V of block src into block dst in every layer."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.copy_blocks(sched.copy_blocks)
        batch = self.prepare(sched)
        hidden = self.model(batch)
        qsl = batch.attn.query_start_loc
        sample_rows, sample_index, prompt_rows = [], [], {}
        for i, s in enumerate(sched.scheduled):
            seq = s.seq
            if seq.params.prompt_logprobs is not None and seq.index == 0 and seq.num_computed_tokens < seq.num_prompt_tokens - 1:
                # rows predicting prompt positions c+1 .. min(c+n, P-1)
                first = seq.num_computed_tokens
                last = min(first + s.num_new_tokens, seq.num_prompt_tokens - 1)
                prompt_rows[i] = (first + 1, hidden[qsl[i]:qsl[i] + (last - first)])
            if s.completes_prompt_or_decodes:
                sample_rows.append(qsl[i + 1] - 1)
                sample_index.append(i)
        logits = self.model.compute_logits(hidden[sample_rows]) if sample_rows else hidden.new_zeros(0, 0)
        prompt_logits = {i: (p, self.model.compute_logits(h)) for i, (p, h) in prompt_rows.items()}
        return RunnerOutput(logits, sample_index, prompt_logits)
