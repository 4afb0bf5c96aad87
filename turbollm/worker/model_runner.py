"""The model runner: a step's plain `SchedulerOutput` → one forward pass → sampled tokens.

It keeps its own state per sequence (`SeqState`: tokens, block tables, sampling parameters, a
seeded request's generator), created from `NewRequestData` and updated from the diffs of later
steps, so it can live in another process than the scheduler. Each step it flattens the
scheduled tokens of all sequences, computes their positions and, per KV-cache group, their KV
slots and block tables, runs the model (embed → layers through its `FusedDecodeStep` when the step
allows it, else the modules → final norm; `LayerHooks` called at the same points either way), and
samples the rows that are up to date (the last new token of a sequence whose every
token is now in the cache) in one batched pass; an n > 1 prompt's row is sampled once per
sibling, and the siblings' states are created here. Prompt logprobs are computed for the prompt
rows of requests that ask for them. Output: `ModelRunnerOutput`, plain data.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from turbollm.attention import AttentionBackend, AttentionMetadata
from turbollm.attention.kv_storage import LayerKVCache
from turbollm.handoff.runner_output import ModelRunnerOutput, PromptLogprobs, SampledToken
from turbollm.handoff.scheduler_output import ForkData, NewRequestData, SchedulerOutput
from turbollm.models.common import CausalLM
from turbollm.models.forward_batch import ForwardBatch, LayerHooks
from turbollm.worker.fused_step import FusedDecodeStep
from turbollm.worker.kv_rings import RecentRings
from turbollm.worker.kv_scores import AttentionScores
from turbollm.worker import rejection
from turbollm.worker.sampler import Sampler, SamplingRow, ranked_logprobs


@dataclass(kw_only=True)
class SeqState(SamplingRow):
    """A worker's copy of one sequence."""

    seq_id: int
    index: int
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0
    ring_slot: int = -1  # a quantized K/V format: its ring of recent tokens (worker/kv_rings.py)
    kv_qlo: int = 0  # ... where its quantized K/V end
    ring_floor: int = 0  # ... and below which its ring holds nothing
    evicted_blocks: int = 0  # attention-score eviction: blocks removed from its tables (core/kv_eviction.py)


@dataclass
class _StepRows:
    """The rows a step samples: plain rows (a state each) with their hidden-state rows, the verifying sequences
    (state, drafts) with all their rows, and prompt rows for prompt logprobs (seq_id -> first position, hidden)."""

    plain: list[SeqState] = field(default_factory=list)
    plain_hidden: list[int] = field(default_factory=list)
    verify: list[tuple[SeqState, list[int]]] = field(default_factory=list)
    verify_hidden: list[int] = field(default_factory=list)
    prompt: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)


def _generator(params, index: int) -> torch.Generator | None:
    return None if params.seed is None else torch.Generator().manual_seed(params.seed + index)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[LayerKVCache], block_size: int,
                 backend: AttentionBackend, fused_decode: bool = True, seed: int | None = None,
                 layer_groups: list[int] | None = None, hooks: LayerHooks | None = None,
                 group_attention: list[tuple[int | None, int]] | None = None, score_rows: int = 0,
                 layers: range | None = None, microbatches: int = 1):
        self.model, self.kv_caches, self.block_size, self.backend = model, kv_caches, block_size, backend
        self.layer_groups = layer_groups or [0] * len(kv_caches)  # per layer, its KV-cache group
        # the layers this runner runs: all, or its pipeline stage's (whose KV caches it alone holds)
        self.layers = layers if layers is not None else range(len(kv_caches))
        self.pipeline = None
        if layers is not None and len(layers) < len(kv_caches):
            from turbollm.worker.pipeline_stage import PipelineStage

            self.pipeline = PipelineStage(self, microbatches)
        self.num_groups = max(self.layer_groups) + 1
        # per group, the (window, sinks) its KV policy sets (KVCacheConfig.group_attention)
        self.group_attention = group_attention or [(None, 0)] * self.num_groups
        self.hooks = hooks
        # an eviction policy: each sequence's last rows' attention mass per table entry (worker/kv_scores.py)
        self.scores = AttentionScores(score_rows) if score_rows else None
        # decode steps and steps of a few tokens may run their layers in one C++ call (None: always the modules)
        self.fused = FusedDecodeStep(model, kv_caches, self.layer_groups, hooks, layers) if fused_decode else None
        self.sampler = Sampler(seed)
        self.states: dict[int, SeqState] = {}
        quantized = any(c.layout.quant for c in kv_caches if c is not None)  # int8 / int4 K/V: each sequence's float16 ring
        self.rings = RecentRings(kv_caches, self.layer_groups) if quantized else None
        # seq_id -> (kv_qlo, ring_floor) of a sequence whose ring a KV connector filled (a decode instance's: its
        # ring came with the prompt's K/V), applied when the sequence arrives
        self.given_rings: dict[int, tuple[int, int]] = {}

    # ------------------------------------------------------------------ state from the diffs
    def update_states(self, sched: SchedulerOutput) -> None:
        for sid in sched.finished_seq_ids:
            st = self.states.pop(sid, None)
            if st is not None and self.rings is not None:
                self.rings.give_back(st)
        for sid in sched.preempted_seq_ids:
            st = self.states.get(sid)
            if st is not None:
                st.block_ids = tuple([] for _ in st.block_ids)
                st.num_computed_tokens = st.evicted_blocks = 0
                if self.rings is not None:
                    self.rings.give_back(st)
        for new in sched.new_reqs:
            self.states[new.seq_id] = st = self._new_state(new)
            if self.rings is not None:
                self.rings.take(st, new.ring_slot)
                if new.seq_id in self.given_rings:
                    st.kv_qlo, st.ring_floor = self.given_rings.pop(new.seq_id)
        for c in sched.cached_reqs:
            st = self.states[c.seq_id]
            if c.evicted_positions:  # before the new blocks: positions in the table as it was
                AttentionScores.remove(st, c.evicted_positions)
            for group, (ids, added) in enumerate(zip(st.block_ids, c.new_block_ids)):
                if c.resumed_from_preemption:
                    ids.clear()
                    st.evicted_blocks = 0
                ids.extend(added)
            for group, pairs in enumerate(c.replaced_block_ids):
                for pos, block in pairs:
                    st.block_ids[group][pos] = block
            st.num_computed_tokens = c.num_computed_tokens
            if c.resumed_from_preemption and self.rings is not None:
                self.rings.take(st, c.ring_slot)
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
    def prepare(self, sched: SchedulerOutput, items: list | None = None) -> ForwardBatch:
        """The batch of `items` ((seq id, new tokens) pairs; all the step's when None)."""
        items = list(sched.scheduled_token_ids.items()) if items is None else items
        ids, pos, qsl, seq_lens, scored = [], [], [0], [], []
        groups = range(self.num_groups)
        slots: list[list[int]] = [[] for _ in groups]
        tables: list[list[list[int]]] = [[] for _ in groups]
        bs = self.block_size
        for sid, tokens in items:
            st = self.states[sid]
            c, n = st.num_computed_tokens, len(tokens)
            ids.extend(tokens)
            pos.extend(range(c, c + n))
            e = st.evicted_blocks  # evicted blocks: the table (and the context attention sees) starts later
            for g in groups:
                table = st.block_ids[g]
                slots[g].extend(table[p // bs - e] * bs + p % bs for p in range(c, c + n))
                tables[g].append(table)
            if self.scores is not None:
                scored.append(self.scores.first_scored_row(qsl[-1], n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n - e * bs)
        metas = [AttentionMetadata(torch.tensor(slots[g], dtype=torch.int64), qsl, seq_lens, _table_tensor(tables[g]),
                                   bs, *self.group_attention[g]) for g in groups]
        if self.rings is not None:
            step = [self.states[sid] for sid, _ in items]
            for meta, recent in zip(metas, self.rings.meta(step, [len(t) for _, t in items])):
                meta.recent = recent
        if self.scores is not None:
            mass = self.scores.key_mass(scored, len(seq_lens), max(len(t) for t in tables[0]))
            for meta in metas:
                meta.key_mass = mass
        return ForwardBatch(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), metas[0],
                            self.kv_caches, self.backend, max_position=max(pos),
                            layer_attn=[metas[g] for g in self.layer_groups] if self.num_groups > 1 else None,
                            hooks=self.hooks)

    def run_model(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of the batch's new tokens: the layers fused when the step allows it, else the modules."""
        return self.model.final_norm(*self.run_layers(self.model.embed(batch.input_ids), batch))

    def run_layers(self, x: torch.Tensor, batch: ForwardBatch,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This runner's layers (all, or its pipeline stage's): (block output, residual stream)."""
        out = self.fused.forward(x, batch, residual=residual) if self.fused is not None else None
        if out is None:
            out = self.model.run_layers(x, batch, self.layers.start, self.layers.stop, residual)
        return out

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy-on-write: duplicate the K/V of block src into block dst in every layer of the group."""
        for g in {c[0] for c in copies}:
            src = torch.tensor([c[1] for c in copies if c[0] == g])
            dst = torch.tensor([c[2] for c in copies if c[0] == g])
            for layer, cache in enumerate(self.kv_caches):
                if self.layer_groups[layer] == g and cache is not None:  # (a pipeline stage: its layers)
                    cache.copy_blocks(src, dst)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(sched)
        out = ModelRunnerOutput()
        if not sched.scheduled_token_ids:  # (a step of KV transfers only: the worker's connector did them)
            return out
        self.copy_blocks(sched.copy_blocks)
        if self.pipeline is not None:  # a pipeline stage: the last one gets the hidden states, the others None
            hidden = self.pipeline.run(sched)
            qsl = list(itertools.accumulate((len(t) for t in sched.scheduled_token_ids.values()), initial=0))
        else:
            batch = self.prepare(sched)
            hidden = self.run_model(batch)
            qsl = batch.attn.query_start_loc
            if batch.attn.key_mass is not None:
                self.scores.collect(sched, batch.attn.key_mass, qsl, self.states, out)
        rows = self._advance(sched, hidden, qsl)
        if hidden is not None and (rows.plain or rows.verify):
            self._sample(hidden, rows, out)
        for sid, (first, h) in rows.prompt.items():
            try:
                out.prompt_logprobs[sid] = self._prompt_logprobs(self.states[sid], first, self.model.compute_logits(h))
            except Exception as e:  # noqa: BLE001 - that request fails, the step goes on
                out.errors[sid] = f"prompt logprobs: {type(e).__name__}: {e}"
        return out

    def _advance(self, sched: SchedulerOutput, hidden: torch.Tensor | None, qsl) -> "_StepRows":
        """Advance each sequence's computed count and pick the rows to sample: the last row of a sequence now up
        to date (once per n > 1 sibling, whose states are made here), every row of a verifying sequence, and
        the prompt rows of a request asking for prompt logprobs."""
        rows = _StepRows()
        for i, (sid, tokens) in enumerate(sched.scheduled_token_ids.items()):
            st = self.states[sid]
            c, n = st.num_computed_tokens, len(tokens)
            drafts = sched.spec_token_ids.get(sid)
            if drafts:  # the last sampled token, then the drafts: every row is sampled, then verified
                rows.verify.append((st, drafts))
                rows.verify_hidden.extend(range(qsl[i], qsl[i + 1]))
                continue
            if hidden is not None and st.params.prompt_logprobs is not None and st.index == 0 \
                    and c < st.num_prompt_tokens - 1:
                last = min(c + n, st.num_prompt_tokens - 1)  # rows predicting prompt positions c+1 .. last
                rows.prompt[sid] = (c + 1, hidden[qsl[i]:qsl[i] + (last - c)])
            st.num_computed_tokens = c + n
            if c + n == len(st.token_ids):
                for fork in sched.forks.get(sid, []):
                    sibling = self._fork_state(st, fork)
                    self.states[fork.seq_id] = sibling
                    if self.rings is not None:
                        self.rings.fork(st, sibling, fork.ring_slot)
                    rows.plain_hidden.append(qsl[i + 1] - 1)
                    rows.plain.append(sibling)
                rows.plain_hidden.append(qsl[i + 1] - 1)
                rows.plain.append(st)
        return rows

    def _sample(self, hidden: torch.Tensor, rows: "_StepRows", out: ModelRunnerOutput) -> None:
        """One LM-head product and one sampling call for every sampled row; then the drafts verified."""
        verify = rows.verify
        all_rows = rows.plain + [row for st, drafts in verify for row in rejection.verify_rows(st, len(drafts))]
        noise = {st.seq_id: st.generator.get_state() for st, _ in verify if rejection.draws_own_noise(st)}
        logits = self.model.compute_logits(hidden[rows.plain_hidden + rows.verify_hidden])
        results = self.sampler.sample(logits, all_rows)
        for st, res in zip(rows.plain, results):
            if res.error is not None:
                out.errors[st.seq_id] = res.error
                continue
            st.token_ids.append(res.token_id)
            out.sampled[st.seq_id] = [SampledToken(res.token_id, res.logprob, res.rank, res.top)]
        first = len(rows.plain)
        for st, drafts in verify:
            rejection.verify_drafts(st, results[first:first + len(drafts) + 1], drafts, out)
            first += len(drafts) + 1
            if st.seq_id in noise:  # the noise of the rows past the last token was never used
                rejection.rewind(st.generator, noise[st.seq_id], len(out.sampled.get(st.seq_id, ())), logits.shape[-1])

    @staticmethod
    def _prompt_logprobs(st: SeqState, first: int, logits: torch.Tensor) -> PromptLogprobs:
        tokens = st.token_ids[first:first + logits.shape[0]]
        return PromptLogprobs(first, tokens, *ranked_logprobs(logits, tokens, st.params.prompt_logprobs))


def _table_tensor(tables: list[list[int]]) -> torch.Tensor:
    """Block tables [B, max blocks], padded with block 0; a released entry (NULL_BLOCK, -1) reads as 0 too
    (out of the window: the kernels never read it, the reference masks it)."""
    width = max(len(t) for t in tables)
    out = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    return out.clamp_(min=0)
