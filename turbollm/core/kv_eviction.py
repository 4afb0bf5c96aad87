"""Attention-score eviction (`--kv-policy h2o | snapkv --kv-budget B`): a sequence keeps at most B
tokens of K/V, its least-attended blocks going back to the pool.

Granularity: whole blocks of the paged pool. A block holds the K/V of its tokens in every layer
and every KV head, so a block is kept or evicted for all of them at once: its score is the
attention mass its keys received, summed over the layers, the query heads and the scored query
rows (H2O and SnapKV choose per layer and head; per-layer tables would be the way there, at one
block table per layer). An evicted block's table entry is removed (the table is compacted): K is
stored after RoPE at its original position, so the kept keys keep their true distance to every
query; a sequence's new tokens go to table slot `position - evicted_blocks * block_size`
(`Sequence.evicted_blocks`), and the attention kernels see a context of the kept tokens only.

After each step that ran a sequence, the workers return the mass each of its table entries got
this step (`ModelRunnerOutput.kv_scores`, from `attention/key_mass.py`), the scorer folds it into
the sequence's state, and when the sequence holds more than `budget_blocks` blocks the manager
releases the lowest-scored blocks outside the protected recent ones (`KVCacheManager.evict`); the
workers hear of the removed table positions with the sequence's next step.

- "h2o" (Heavy-Hitter Oracle): the score is the mass accumulated from every query since the
  block was written (prompt rows and decodes); the newest budget/2 tokens (rounded down to whole
  blocks) are always kept.
- "snapkv": the score is the mass from the last `SNAPKV_OBSERVE` queries only (the observation
  window: a prompt chunk's last rows, then the last decodes; at step granularity: the steps that
  hold the last 32 rows); the newest blocks covering the observation window are always kept. SnapKV's 1-D pooling of neighbouring scores is left out:
  a block's sum already clusters its tokens.

A sequence under either policy holds at most `budget_blocks` blocks after a step, plus the blocks
of the step's new tokens while it runs, so the pool is capped like a sliding window's
(`max_blocks`) and the prefix cache is off for these policies (an evicted table no longer matches
the prompt's block hashes; the engine switches caching off and says so).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from turbollm.handoff.kv_cache_spec import KVCacheSpec

SNAPKV_OBSERVE = 32  # SnapKV's observation window: the last 32 queries vote
ALL_ROWS = 1 << 30  # a scorer that reads every query row of a step


@dataclass(frozen=True)
class EvictionSpec(KVCacheSpec):
    """Full attention over at most `budget` tokens per sequence (whole blocks), chosen by `score`."""

    budget: int = 0
    score: str = "h2o"

    @property
    def kind(self) -> str:
        return f"{self.score}(budget={self.budget}, recent={self.recent})"

    @property
    def bounded(self) -> bool:
        return True

    @property
    def budget_blocks(self) -> int:
        return self.budget // self.layout.block_size

    @property
    def recent(self) -> int:
        """The newest tokens never evicted."""
        return SCORERS[self.score].recent(self.budget, self.layout.block_size)

    @property
    def score_rows(self) -> int:
        return SCORERS[self.score].rows

    def max_blocks(self, max_num_seqs: int, max_num_batched_tokens: int, spec_tokens: int = 0) -> int | None:
        """Each sequence slot `budget_blocks` after its step, plus its partial block and one copied on write;
        the step's new tokens (summing to the token budget) on top."""
        bs = self.layout.block_size
        return max_num_seqs * (self.budget_blocks + 2) + -(-max_num_batched_tokens // bs) + max_num_seqs


class BlockScorer:
    """How a policy scores a sequence's blocks; its per-sequence state lives in `Sequence.kv_score_state`."""

    rows = ALL_ROWS  # the last query rows of each step whose attention is counted

    @staticmethod
    def recent(budget: int, block_size: int) -> int:
        raise NotImplementedError

    def observe(self, state, mass: list[float], rows: int):
        """Fold one step's mass per table entry (`rows` query rows counted) into `state`; returns the state."""
        raise NotImplementedError

    def scores(self, state, n: int) -> list[float]:
        """The score of each of the first `n` table entries."""
        raise NotImplementedError

    def remove(self, state, positions: list[int]) -> None:
        """Table entries `positions` (descending) were evicted: drop them from the state."""
        raise NotImplementedError


def _pad(values: list[float], n: int) -> list[float]:
    return values[:n] + [0.0] * (n - len(values))


class H2OScorer(BlockScorer):
    @staticmethod
    def recent(budget: int, block_size: int) -> int:
        return max(block_size, budget // 2 // block_size * block_size)

    def observe(self, state, mass, rows):
        acc = state if state is not None else []
        acc.extend([0.0] * (len(mass) - len(acc)))
        for i, m in enumerate(mass):
            acc[i] += m
        return acc

    def scores(self, state, n):
        return _pad(state or [], n)

    def remove(self, state, positions):
        for i in positions:
            if state is not None and i < len(state):
                del state[i]


class SnapKVScorer(BlockScorer):
    rows = SNAPKV_OBSERVE

    @staticmethod
    def recent(budget: int, block_size: int) -> int:
        return -(-SNAPKV_OBSERVE // block_size) * block_size

    def observe(self, state, mass, rows):
        window = state if state is not None else deque()
        window.append((rows, list(mass)))
        while sum(r for r, _ in window) - window[0][0] >= SNAPKV_OBSERVE:  # older steps fell out of the window
            window.popleft()
        return window

    def scores(self, state, n):
        out = [0.0] * n
        for _, mass in state or ():
            for i, m in enumerate(mass[:n]):
                out[i] += m
        return out

    def remove(self, state, positions):
        for _, mass in state or ():
            for i in positions:
                if i < len(mass):
                    del mass[i]


SCORERS: dict[str, BlockScorer] = {"h2o": H2OScorer(), "snapkv": SnapKVScorer()}


def choose_evictions(scores: list[float], num_blocks: int, protected_from: int, budget_blocks: int) -> list[int]:
    """Table positions to evict (descending): the lowest-scored entries before `protected_from`, as many as
    bring `num_blocks` down to `budget_blocks` (fewer when the protected entries alone exceed it); ties
    go to the older block."""
    excess = num_blocks - budget_blocks
    if excess <= 0:
        return []
    # a NaN score (a NaN query) ranks lowest, so the order stays total
    candidates = sorted(range(min(protected_from, num_blocks)),
                        key=lambda i: (-math.inf if math.isnan(scores[i]) else scores[i], i))
    return sorted(candidates[:excess], reverse=True)


class Evictor:
    """The scheduler side of attention-score eviction, one object: it folds the workers' attention mass into
    each sequence's scorer state (`observe`) and picks the table positions to remove when the sequence holds
    more than its budget (`choose`); `KVCacheManager.evict` releases them. The worker side is
    worker/kv_scores.py."""

    def __init__(self, spec: EvictionSpec):
        self.spec, self.scorer = spec, SCORERS[spec.score]

    def observe(self, seq, rows: int, mass: list[float]) -> None:
        """A step's attention mass per table entry of `seq` (`rows` query rows counted)."""
        seq.kv_score_state = self.scorer.observe(seq.kv_score_state, mass, rows)

    def choose(self, seq, num_entries: int, block_size: int) -> list[int]:
        """Table positions of `seq` to remove (descending), never its newest `recent` tokens' blocks."""
        protected_from = max(0, (seq.num_computed_tokens - self.spec.recent) // block_size - seq.evicted_blocks)
        return choose_evictions(self.scorer.scores(seq.kv_score_state, num_entries), num_entries, protected_from,
                                self.spec.budget_blocks)

    def removed(self, seq, positions: list[int]) -> None:
        """Positions of `seq`'s table were removed: its scorer state drops them."""
        self.scorer.remove(seq.kv_score_state, positions)
