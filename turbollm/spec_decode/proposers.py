"""Proposers behind one interface: `propose(seq_id, token_ids, k)` -> up to k draft tokens that may
follow `token_ids` (sequence `seq_id`'s prompt and output so far), and `finish(seq_id, output)` when
that sequence ends; looked up by method name in `PROPOSERS`.

`NgramProposer` is prompt lookup: the longest suffix of the sequence, from `prompt_lookup_max`
tokens down to `prompt_lookup_min`, that occurred earlier in it; the tokens that followed its most
recent earlier occurrence are the drafts. It needs nothing but the tokens (no model, no state).
`suffix.py` holds the suffix-tree proposer, `draft_model.py` the draft model's. They run on the worker
side (worker/drafter.py), after each step, on the tokens it sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from turbollm.spec_decode.config import SpeculativeConfig


@dataclass
class ProposerContext:
    """What a proposer may need of the worker beyond its config (a draft model: the KV pool's block size,
    where a sequence's block table is, how to load the draft's runner)."""

    block_size: int = 16  # tokens per KV block of the target
    block_table: Callable[[int], list[int]] | None = None  # seq_id -> its (group 0) block table, live
    make_draft_runner: Callable[[SpeculativeConfig], Any] | None = None  # worker/draft_runner.py's DraftRunner.load


class Proposer:
    """A draft source. Drafts are a function of the sequence's tokens and of what the proposer saw
    before (never random), so verification is rejection sampling with a one-hot q."""

    #: the proposer writes K/V into the sequence's blocks (a draft model): the scheduler reserves the
    #: blocks for the drafts' positions with their room (`drafts_write_kv`)
    needs_blocks = False
    #: the proposer's own measure of what one more draft token costs (seconds), when its calls also do
    #: other work (a draft model catching up on verified tokens); None: the planner times the calls
    seconds_per_draft: float | None = None

    def propose(self, seq_id: int, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens to follow token_ids (fewer, or none, when it has no guess)."""
        raise NotImplementedError

    def finish(self, seq_id: int, output_token_ids: list[int]) -> None:
        """Sequence `seq_id` ended (finished, aborted or failed) with these generated tokens."""

    def preempted(self, seq_id: int) -> None:
        """Sequence `seq_id` lost its blocks (preempted): K/V written into them is gone."""


PROPOSERS: dict[str, Callable[[SpeculativeConfig, ProposerContext], Proposer]] = {}


def register_proposer(method: str):
    def deco(factory):
        PROPOSERS[method] = factory
        return factory
    return deco


def proposer_class(method: str):
    if method not in PROPOSERS:
        raise NotImplementedError(f"speculative method {method!r} has no proposer yet "
                                  f"(available: {', '.join(sorted(PROPOSERS))})")
    return PROPOSERS[method]


def drafts_write_kv(config: SpeculativeConfig) -> bool:
    """Whether `config`'s proposer writes the drafts' K/V into the sequence's blocks (the scheduler then
    reserves them)."""
    return bool(proposer_class(config.method).needs_blocks)


def make_proposer(config: SpeculativeConfig, context: ProposerContext | None = None) -> Proposer:
    return proposer_class(config.method)(config, context or ProposerContext())


@register_proposer("ngram")
class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seq_id: int, token_ids: list[int], k: int) -> list[int]:
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n:]
            # the most recent earlier occurrence whose continuation is inside the sequence
            for start in range(length - n - 1, -1, -1):
                if token_ids[start:start + n] == suffix:
                    return token_ids[start + n:start + n + k]
        return []
