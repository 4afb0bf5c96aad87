"""One sequence being generated: its tokens, how many are in the KV cache, its blocks.

The scheduler's single rule works on two counters: `num_computed_tokens` (tokens whose
K/V are in the cache) and `num_tokens` (prompt + generated). Each step closes part of the
gap. A preempted sequence drops its blocks and its computed count returns to zero.

A `Sequence` lives on the engine side only (scheduler and output processor); workers see it as
plain data (`scheduler_output.py`) and keep their own state per `seq_id`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from turbollm.outputs import PositionLogprobs
from turbollm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler looks sequences up in its lists
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n outputs
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = field(default_factory=list)  # one per KV-cache group (KVCacheManager)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    text: str = ""
    detokenizer: object = None
    block_hashes: list[bytes] = field(default_factory=list)  # prefix keys of its full blocks, in order
    num_cached_blocks: int = 0  # leading blocks already indexed in the prefix cache
    # a KV connector: a load of its prefix's blocks failed (it computes them itself, asking the outside no more);
    # a producer's hand-off for its consumer (the `kv_transfer_params` of its output)
    external_failed: bool = False
    kv_transfer_out: dict | None = None
    pending_forks: int = 0  # n > 1: siblings to fork off once the prompt is computed
    end_token_ids: frozenset[int] = frozenset()  # ids that end it: stop_token_ids, plus EOS unless ignore_eos
    # what the workers know of it (the scheduler sends only the difference): whether they have it,
    # and how many entries of its block tables they hold
    known_to_workers: bool = False
    num_blocks_sent: int = 0
    # attention-score eviction (core/kv_eviction.py): table entries removed so far (its table then
    # starts at position evicted_blocks * block_size), the scorer's state, and the removed table positions
    # the workers have not heard of yet (in the order to apply them)
    evicted_blocks: int = 0
    kv_score_state: object = None
    pending_evictions: list[int] = field(default_factory=list)
    # speculative decoding: the draft tokens the workers proposed after its last step, for its next one
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens start .. stop - 1 of prompt + output, without building the whole list."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]
