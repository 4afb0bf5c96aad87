"""One sequence being generated: its tokens, how many are in the KV cache, its blocks.

The scheduler's single rule works on two counters: `num_computed_tokens` (tokens whose
K/V are in the cache) and `num_tokens` (prompt + generated). Each step closes part of the
gap. A preempted sequence drops its blocks and its computed count returns to zero.
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
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    text: str = ""
    generator: object = None  # torch.Generator when the request has a seed
    detokenizer: object = None
    block_hashes: list[bytes] = field(default_factory=list)  # prefix keys of its full blocks, in order
    num_cached_blocks: int = 0  # leading blocks already indexed in the prefix cache
    pending_forks: int = 0  # n > 1: siblings to fork off once the prompt is computed

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

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]
