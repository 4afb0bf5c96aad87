"""What a worker returns for a step: the sampled token ids and their logprobs per sequence, the
prompt logprobs asked for, the sequences whose sampling failed, and with speculative decoding the
drafts proposed for each sequence's next step. Plain data, picklable.

Logprobs are of the raw model distribution (before penalties, temperature and filters), as vLLM
reports them; token text is added on the engine side (the workers have no tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turbollm.handoff.kv_transfer import KVTransferStats


@dataclass
class SampledToken:
    token_id: int
    logprob: float = 0.0  # 0.0 when the request asked for no logprobs
    rank: int = 0  # 1-based rank in the raw distribution (0 when not asked for)
    top: list[tuple[int, float]] = field(default_factory=list)  # the top k (id, logprob) when asked for


@dataclass
class PromptLogprobs:
    """Logprobs of prompt positions `first_pos ..` (each given the tokens before it)."""

    first_pos: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]  # per position, the top k (empty when k = 0)


@dataclass
class ModelRunnerOutput:
    # seq_id -> the tokens sampled for it this step (one, or a verified step's accepted drafts and the target's
    # token after them). A forked
    # sibling appears under its own seq_id the step it is created.
    sampled: dict[int, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # seq_id -> why sampling it failed
    # attention-score eviction: seq_id -> (query rows counted, the attention mass each table entry got
    # this step, summed over layers, heads and those rows)
    kv_scores: dict[int, tuple[int, list[float]]] = field(default_factory=dict)
    # speculative decoding (worker/drafter.py): seq_id -> draft tokens to follow what it sampled this step
    # (at most the room `SchedulerOutput.draft_room` gave it), the proposer's time this step, and its own
    # measure of one more draft token's cost (a draft model's one-token step; None: the time per draft)
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    propose_seconds: float = 0.0
    seconds_per_draft: float | None = None
    # the seconds the worker spent on this step (`Worker.execute_model`, drafting included): against the
    # engine's wait for it, what crossing the process boundary cost (scripts/mp_overhead.py)
    worker_seconds: float = 0.0
    # a KV connector: seq_id -> whether every block loaded for it this step arrived whole (False: the scheduler
    # frees them and the sequence computes its prefix itself), and what the connector did
    kv_loaded: dict[int, bool] = field(default_factory=dict)
    kv_stats: KVTransferStats | None = None
    kv_waiting: list[int] = field(default_factory=list)  # remote loads whose hand-off is not there yet
