"""What the scheduler hands the executor each step: plain data only, picklable, so a worker in
another process can run the step and keep its own per-sequence state from these diffs.

A sequence is new to the workers the first time it is scheduled (`NewRequestData`: all it needs,
its tokens included); afterwards only what changed is sent (`CachedRequestData`: blocks added or
replaced, whether it resumes after a preemption). Every step lists the token ids each scheduled
sequence computes (`scheduled_token_ids`: the next chunk of a prompt, the last sampled token, and
the draft tokens the workers proposed after the step before, `spec_token_ids`), in batch order. Block ids are per KV-cache
group (a tuple with one list per group, `handoff/kv_cache_spec.py`); an entry `NULL_BLOCK` (-1) is
a block a sliding-window group released, never read. Sequences are named by `seq_id`, an int
unique within the engine: a request with n > 1 samples has n of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turbollm.handoff.kv_transfer import KVTransferMeta
from turbollm.sampling_params import SamplingParams

BlockIds = tuple[list[int], ...]  # one list of block ids per KV-cache group
NULL_BLOCK = -1  # a released table entry (out of a sliding window): nothing is stored there


@dataclass
class NewRequestData:
    """A sequence the workers have not seen yet."""

    seq_id: int
    index: int  # which of its request's n samples (a seeded sample draws with seed + index)
    token_ids: list[int]  # every token it has so far: the prompt, then any generated ones
    num_prompt_tokens: int
    params: SamplingParams
    end_token_ids: list[int]  # what `min_tokens` masks: stop_token_ids, plus EOS unless ignore_eos
    block_ids: BlockIds
    num_computed_tokens: int  # tokens whose K/V are already in its blocks (a prefix-cache hit)
    ring_slot: int = -1  # a quantized K/V format: its float16 ring of recent tokens (pool blocks the scheduler took)


@dataclass
class CachedRequestData:
    """A sequence the workers know: what changed since they last saw it."""

    seq_id: int
    new_block_ids: BlockIds  # appended to its tables (the whole tables when `resumed_from_preemption`)
    num_computed_tokens: int
    resumed_from_preemption: bool = False
    # per group: (position in the table, new block id), applied before the step: a copy-on-write
    # copy, or NULL_BLOCK for a block released out of a sliding window
    replaced_block_ids: tuple[list[tuple[int, int]], ...] = ()
    # attention-score eviction: table positions removed since the last step, deleted one after another
    # (every group's table) before new blocks are appended; the sequence's table then starts that many
    # blocks later (`core/kv_eviction.py`)
    evicted_positions: list[int] = field(default_factory=list)
    ring_slot: int = -1  # resumed under a quantized K/V format: its new ring slot


@dataclass
class ForkData:
    """n > 1: siblings that fork off a sequence at its first sample, sharing its blocks."""

    seq_id: int
    index: int
    ring_slot: int = -1  # a quantized K/V format: the sibling's own ring, a copy of its parent's


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # seq_id -> the token ids it computes this step, in batch order (len = its scheduled tokens)
    scheduled_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # seq_id -> the draft tokens at the end of its scheduled tokens (speculative decoding: the step
    # verifies them; its last sampled token comes first, then these)
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # seq_id -> how many draft tokens the workers may propose for it after this step, on the tokens it
    # samples (speculative decoding: the room the scheduler reserved; with a proposer that writes K/V, a
    # draft model, its blocks are in the sequence's tables already). The drafts come back in
    # `ModelRunnerOutput.draft_token_ids` and are verified in the sequence's next step.
    draft_room: dict[int, int] = field(default_factory=dict)
    # parent seq_id -> the siblings sampled from its row when this step completes its prompt
    forks: dict[int, list[ForkData]] = field(default_factory=dict)
    # copy-on-write: (group, src, dst), done in that group's layers before the forward pass
    copy_blocks: list[tuple[int, int, int]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # since the last step: workers drop them
    preempted_seq_ids: list[int] = field(default_factory=list)  # this step: their blocks are gone
    # sequences that cannot fit in the whole KV pool: taken out, to be ended with an error
    unschedulable_seq_ids: list[int] = field(default_factory=list)
    # a KV connector's loads and saves, done before the forward pass (handoff/kv_transfer.py)
    kv_transfer: KVTransferMeta = field(default_factory=KVTransferMeta)

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to do: no tokens to compute and no blocks to load or save."""
        return not self.scheduled_token_ids and not self.kv_transfer
