"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): drafts from the continuations of the longest
recent pattern seen before, in this request or in earlier requests' outputs.

Two depth-bounded suffix trees (`SuffixTrie`: every substring of at most `depth` tokens of what was
added, with its number of occurrences): one per running request over its prompt and output, extended
a token at a time, and one global tree over the outputs of the last `max_cached_requests` finished
requests, the oldest evicted (its substrings' counts taken back) as new ones arrive. To propose, the
longest suffix of the sequence (up to depth - k tokens, leaving room for k drafts below it) that has
a continuation in a tree is matched,
then the most frequent child is followed while the product of the count ratios (an estimate of the
probability that the target continues that way) stays at or above `min_token_prob`, for at most
k and `max_spec_factor` × the pattern's length tokens. Of the two trees' drafts the one with the
larger expected number of accepted tokens (the sum of those products) is used.
"""

from __future__ import annotations

from collections import OrderedDict

from turbollm.spec_decode.config import SpeculativeConfig
from turbollm.spec_decode.proposers import Proposer, ProposerContext, register_proposer


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Occurrence counts of every substring of at most `depth` tokens of the sequences added."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 0

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Count every substring of `tokens` up to the depth once more (sign=1) or once less (sign=-1;
        the substrings must have been added), dropping nodes whose count reaches zero."""
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start:start + self.depth]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                    self.num_nodes += 1
                child.count += sign
                if child.count == 0:
                    self.num_nodes -= _size(child)
                    del node.children[t]
                    break
                node = child

    def extend(self, active: list[_Node], token: int) -> list[_Node]:
        """Append `token` to a sequence being indexed: `active` holds the nodes of its suffixes shorter
        than the depth (by length, 1 first); returns the new list."""
        new = []
        for node in [self.root] + active:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += 1
            if len(new) + 1 < self.depth:
                new.append(child)
        return new

    def find(self, pattern: list[int]) -> _Node | None:
        node = self.root
        for t in pattern:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def draft(self, context: list[int], k: int, max_spec_factor: float, min_prob: float
              ) -> tuple[list[int], float]:
        """Drafts after the longest suffix of `context` with a continuation here (at most depth - k tokens
        long, so that k drafts fit under the depth), and their expected number of accepted tokens."""
        for m in range(min(len(context), max(1, self.depth - k)), 0, -1):
            node = self.find(context[len(context) - m:])
            if node is None or not node.children:
                continue
            limit = min(k, int(max_spec_factor * m), self.depth - m)
            tokens, prob, expected = [], 1.0, 0.0
            while node.children and len(tokens) < limit:
                total = sum(c.count for c in node.children.values())
                token, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))  # ties: lowest id
                prob *= child.count / total
                if prob < min_prob:
                    break
                tokens.append(token)
                expected += prob
                node = child
            return tokens, expected
        return [], 0.0


def _size(node: _Node) -> int:
    return 1 + sum(_size(c) for c in node.children.values())


@register_proposer("suffix")
class SuffixProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.factor, self.min_prob = config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob
        self.global_tree = SuffixTrie(self.depth)
        self.cached: OrderedDict[int, list[int]] = OrderedDict()  # outputs in the global tree, oldest first
        # per running sequence: its tree, the active nodes, how many of its tokens are indexed
        self.requests: dict[int, tuple[SuffixTrie, list[_Node], int]] = {}

    def propose(self, seq_id: int, token_ids: list[int], k: int) -> list[int]:
        tree, active, done = self.requests.get(seq_id) or (SuffixTrie(self.depth), [], 0)
        for t in token_ids[done:]:
            active = tree.extend(active, t)
        self.requests[seq_id] = (tree, active, len(token_ids))
        # the request's own tree holds the sequence itself: its current suffixes have no continuation
        # yet, so a matched pattern's children are its earlier occurrences' continuations
        own = tree.draft(token_ids, k, self.factor, self.min_prob)
        other = self.global_tree.draft(token_ids, k, self.factor, self.min_prob)
        return (own if own[1] >= other[1] else other)[0]

    def finish(self, seq_id: int, output_token_ids: list[int]) -> None:
        self.requests.pop(seq_id, None)
        if self.max_cached == 0 or not output_token_ids:
            return
        self.global_tree.add(list(output_token_ids))
        self.cached[seq_id] = list(output_token_ids)
        while len(self.cached) > self.max_cached:
            _, old = self.cached.popitem(last=False)
            self.global_tree.add(old, sign=-1)

