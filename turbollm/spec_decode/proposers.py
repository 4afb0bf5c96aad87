"""Proposers behind one interface: `propose(seq_id, token_ids, k)` -> up to k draft tokens that may
follow `token_ids` (sequence `seq_id`'s prompt and output so far), and `finish(seq_id, output)` when
that sequence ends; looked up by method name in `PROPOSERS`.

`NgramProposer` is prompt lookup: the longest suffix of the sequence, from `prompt_lookup_max`
tokens down to `prompt_lookup_min`, that occurred earlier in it; the tokens that followed its most
recent earlier occurrence are the drafts. It needs nothing but the tokens (no model, no state), so
it runs wherever the scheduler does. `suffix.py` holds the suffix-tree proposer.
"""

from __future__ import annotations

from typing import Callable

from turbollm.spec_decode.config import SpeculativeConfig


class Proposer:
    """A draft source. Drafts are a function of the sequence's tokens and of what the proposer saw
    before (never random), so verification is rejection sampling with a one-hot q."""

    def propose(self, seq_id: int, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens to follow token_ids (fewer, or none, when it has no guess)."""
        raise NotImplementedError

    def finish(self, seq_id: int, output_token_ids: list[int]) -> None:
        """Sequence `seq_id` ended (finished, aborted or failed) with these generated tokens."""


PROPOSERS: dict[str, Callable[[SpeculativeConfig], Proposer]] = {}


def register_proposer(method: str):
    def deco(factory):
        PROPOSERS[method] = factory
        return factory
    return deco


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method not in PROPOSERS:
        raise NotImplementedError(f"speculative method {config.method!r} has no proposer yet "
                                  f"(available: {', '.join(sorted(PROPOSERS))})")
    return PROPOSERS[config.method](config)


@register_proposer("ngram")
class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
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
