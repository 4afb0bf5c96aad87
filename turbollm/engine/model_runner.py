"""The model runner: a step's plain `SchedulerOutput` → one forward pass → sampled tokens.

It keeps its own state per sequence (`SeqState`: tokens, block tables, sampling parameters, a
seeded request's generator), created from `NewRequestData` and updated from the diffs of later
steps, so it can live in another process than the scheduler. Each step it flattens the
scheduled tokens of all sequences, computes their positions and KV slots from the tables, runs
the model, and samples the rows that are up to date (the last new token of a sequence whose every
token is now in the cache) in one batched pass; an n > 1 prompt's row is sampled once per
sibling, and the siblings' states are created here. Prompt logprobs are computed for the prompt
rows of requests that ask for them. Output: `ModelRunnerOutput`, plain data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from turbollm.attention import AttentionBackend, AttentionMetadata
from turbollm.engine.runner_output import ModelRunnerOutput, PromptLogprobs, SampledToken
from turbollm.engine.sampler import Sampler, SamplingRow, ranked_logprobs
from turbollm.engine.scheduler_output import ForkData, NewRequestData, SchedulerOutput
from turbollm.models import decode_step
from turbollm.models.common import CausalLM
from turbollm.models.forward_batch import ForwardBatch


@dataclass(kw_only=True)
class SeqState(SamplingRow):
    """A worker's copy of one sequence."""

    seq_id: int
    index: int
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0


def _generator(params, index: int) -> torch.Generator | None:
    return None if params.seed is None else torch.Generator().manual_seed(params.seed + index)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 backend: AttentionBackend, fused_decode: bool = True, seed: int | None = None):
        self.model, self.kv_caches, self.block_size, self.backend = model, kv_caches, block_size, backend
        self.fused_decode = fused_decode  # pure-decode steps may run their layers in one C++ call
        self.sampler = Sampler(seed)
        self.states: dict[int, SeqState] = {}
        decode_step.reset(model.model)  # a step built for another runner holds that runner's K/V

    # ------------------------------------------------------------------ state from the diffs
    def update_states(self, sched: SchedulerOutput) -> None:
        for sid in sched.finished_seq_ids:
            self.states.pop(sid, None)
        for sid in sched.preempted_seq_ids:
            st = self.states.get(sid)
            if st is not None:
                st.block_ids = tuple([] for _ in st.block_ids)
                st.num_computed_tokens = 0
        for new in sched.new_reqs:
            self.states[new.seq_id] = self._new_state(new)
        for c in sched.cached_reqs:
            st = self.states[c.seq_id]
            for group, (ids, added) in enumerate(zip(st.block_ids, c.new_block_ids)):
                if c.resumed_from_preemption:
                    ids.clear()
                ids.extend(added)
            for group, pairs in enumerate(c.replaced_block_ids):
                for pos, block in pairs:
                    st.block_ids[group][pos] = block
            st.num_computed_tokens = c.num_computed_tokens
        for sid, tokens in sched.scheduled_token_ids.items():
            st = self.states[sid]
            c = st.num_computed_tokens
            st.token_ids[c:c + len(tokens)] = tokens

    @staticmethod
    def _new_state(new: NewRequestData) -> SeqState:
        return SeqState(params=new.params, token_ids=list(new.token_ids), num_prompt_tokens=new.num_prompt_tokens,
                        end_token_ids=list(new.end_token_ids), generator=_generator(new.params, new.index),
                        seq_id=new.seq_id, index=new.index, block_ids=tuple(list(b) for b in new.block_ids),
                        num_computed_tokens=new.num_computed_tokens)

    @staticmethod
    def _fork_state(parent: SeqState, fork: ForkData) -> SeqState:
        """A sibling's state: the parent's, with its own id, index, generator and copies of the lists."""
        return dataclasses.replace(parent, token_ids=list(parent.token_ids), seq_id=fork.seq_id, index=fork.index,
                                   generator=_generator(parent.params, fork.index),
                                   block_ids=tuple(list(b) for b in parent.block_ids))

    # ------------------------------------------------------------------ the step
    def prepare(self, sched: SchedulerOutput) -> ForwardBatch:
        ids, pos, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        bs = self.block_size
        for sid, tokens in sched.scheduled_token_ids.items():
            st = self.states[sid]
            c, n = st.num_computed_tokens, len(tokens)
            ids.extend(tokens)
            pos.extend(range(c, c + n))
            table = st.block_ids[0]
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
            tables.append(table)
        width = max(len(t) for t in tables)
        block_tables = torch.zeros(len(tables), width, dtype=torch.int64)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64), qsl, seq_lens, block_tables, bs)
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
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(sched)
        out = ModelRunnerOutput()
        if sched.is_empty:
            return out
        self.copy_blocks(sched.copy_blocks)
        batch = self.prepare(sched)
        hidden = self.model(batch)
        qsl = batch.attn.query_start_loc
        sample_rows, rows, prompt_rows = [], [], {}
        for i, (sid, tokens) in enumerate(sched.scheduled_token_ids.items()):
            st = self.states[sid]
            c, n = st.num_computed_tokens, len(tokens)
            if st.params.prompt_logprobs is not None and st.index == 0 and c < st.num_prompt_tokens - 1:
                last = min(c + n, st.num_prompt_tokens - 1)  # rows predicting prompt positions c+1 .. last
                prompt_rows[sid] = (c + 1, hidden[qsl[i]:qsl[i] + (last - c)])
            st.num_computed_tokens = c + n
            if c + n == len(st.token_ids):
                for fork in sched.forks.get(sid, []):
                    sibling = self._fork_state(st, fork)
                    self.states[fork.seq_id] = sibling
                    sample_rows.append(qsl[i + 1] - 1)
                    rows.append(sibling)
                sample_rows.append(qsl[i + 1] - 1)
                rows.append(st)
        if rows:
            logits = self.model.compute_logits(hidden[sample_rows])
            for st, res in zip(rows, self.sampler.sample(logits, rows)):
                if res.error is not None:
                    out.errors[st.seq_id] = res.error
                    continue
                st.token_ids.append(res.token_id)
                out.sampled[st.seq_id] = [SampledToken(res.token_id, res.logprob, res.rank, res.top)]
        for sid, (first, h) in prompt_rows.items():
            try:
                out.prompt_logprobs[sid] = self._prompt_logprobs(self.states[sid], first, self.model.compute_logits(h))
            except Exception as e:  # noqa: BLE001 - that request fails, the step goes on
                out.errors[sid] = f"prompt logprobs: {type(e).__name__}: {e}"
        return out

    @staticmethod
    def _prompt_logprobs(st: SeqState, first: int, logits: torch.Tensor) -> PromptLogprobs:
        tokens = st.token_ids[first:first + logits.shape[0]]
        return PromptLogprobs(first, tokens, *ranked_logprobs(logits, tokens, st.params.prompt_logprobs))
