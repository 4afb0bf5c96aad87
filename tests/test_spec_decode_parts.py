"""Speculative decoding's parts outside the engine core (turbollm/spec_decode): the configuration's
checks (vLLM's field names, an error naming the field for every bad value) and the n-gram proposer
against a brute-force reference."""

from __future__ import annotations

import collections
import random

import pytest

from turbollm.errors import InvalidRequestError
from turbollm.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig, parse_speculative_config
from turbollm.spec_decode.proposers import NgramProposer, make_proposer


def test_config_parses_dicts_and_json():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert c == SpeculativeConfig("ngram", 3, 2, 5, None, True)
    d = parse_speculative_config({"method": "draft_model", "model": "qwen2.5-coder-0.5b",
                                  "num_speculative_tokens": MAX_SPECULATIVE_TOKENS, "adaptive": False})
    assert d.model == "qwen2.5-coder-0.5b" and d.num_speculative_tokens == 7 and not d.adaptive
    assert parse_speculative_config(None) is None and parse_speculative_config(c) is c
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 6}).prompt_lookup_max == 6


@pytest.mark.parametrize("value,field", [
    ("{not json", "JSON"),
    ([1, 2], "JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "'method'"),
    ({"method": "ngram"}, "'num_speculative_tokens' is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "'num_speculative_tokens' must be 1..7"),
    ({"method": "ngram", "num_speculative_tokens": 8}, "'num_speculative_tokens' must be 1..7"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "'num_speculative_tokens' must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": True}, "'num_speculative_tokens' must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "'prompt_lookup_min' (4) is above"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "'prompt_lookup_min' must be"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "'model' is only for draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "'adaptive'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "unknown field(s) 'k'"),
])
def test_config_errors_name_the_field(value, field):
    with pytest.raises(InvalidRequestError) as e:
        parse_speculative_config(value)
    assert field in str(e.value)


def _ngram_reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Every (n, start) pair tried in the documented order: longest n first, latest start first."""
    for n in range(hi, lo - 1, -1):
        if n > len(tokens) - 1:
            continue
        matches = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if matches:
            s = max(matches)
            return tokens[s + n:s + n + k]
    return []


def test_ngram_proposer_examples():
    p = NgramProposer(SpeculativeConfig("ngram", 3, 2, 3))
    #               a  b  c  d  e  a  b  c   -> "a b c" seen at 0, followed by d e a
    assert p.propose(0, [1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert p.propose(0, [1, 2, 3, 4, 5, 1, 2, 3], 1) == [4]
    assert p.propose(0, [1, 2, 3, 4], 3) == []  # no repeat
    assert p.propose(0, [7, 8, 9, 7, 8, 1, 7, 8], 2) == [1, 7]  # the most recent earlier "7 8" (at 3)
    assert p.propose(0, [5, 6, 5, 6], 4) == [5, 6]  # continuation cut at the sequence's end
    assert p.propose(0, [], 3) == [] and p.propose(0, [4], 3) == []
    assert make_proposer(SpeculativeConfig("ngram", 2)).propose(0, [1, 2, 1, 2], 2) == [1, 2]
    with pytest.raises(NotImplementedError, match="eagle"):
        make_proposer(SpeculativeConfig("eagle", 2))
    with pytest.raises(InvalidRequestError, match="inside a worker"):
        make_proposer(SpeculativeConfig("draft_model", 2, model="x"))


def test_ngram_proposer_matches_brute_force():
    rng = random.Random(3)
    for _ in range(2000):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 7)
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(0, 30))]
        got = NgramProposer(SpeculativeConfig("ngram", k, lo, hi)).propose(0, tokens, k)
        assert got == _ngram_reference(tokens, k, lo, hi), (tokens, k, lo, hi)


# ---------------------------------------------------------------------------------------------- suffix
def _substring_counts(seqs: list[list[int]], depth: int) -> collections.Counter:
    counts = collections.Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                counts[tuple(s[i:j])] += 1
    return counts


def _suffix_reference(counts, context, k, depth, factor, min_prob):
    """Brute force over substring counts: the longest suffix (at most depth - k, at least 1) with a
    continuation, then the most frequent next token (ties: lowest id) while the product of count
    ratios stays >= min_prob."""
    for m in range(min(len(context), max(1, depth - k)), 0, -1):
        pattern = tuple(context[len(context) - m:])
        nexts = {key[-1]: c for key, c in counts.items() if len(key) == m + 1 and key[:-1] == pattern}
        if not nexts:
            continue
        tokens, prob, expected = [], 1.0, 0.0
        limit = min(k, int(factor * m), depth - m)
        while nexts and len(tokens) < limit:
            token = min(nexts, key=lambda t: (-nexts[t], t))
            prob *= nexts[token] / sum(nexts.values())
            if prob < min_prob:
                break
            tokens.append(token)
            expected += prob
            pattern = pattern + (token,)
            nexts = {key[-1]: c for key, c in counts.items() if len(key) == len(pattern) + 1
                     and key[:-1] == pattern}
        return tokens, expected
    return [], 0.0


def test_suffix_trie_drafts_match_brute_force():
    from turbollm.spec_decode.suffix import SuffixTrie

    rng = random.Random(5)
    for trial in range(300):
        depth = rng.randint(2, 7)
        seqs = [[rng.randint(0, 3) for _ in range(rng.randint(0, 14))] for _ in range(rng.randint(1, 3))]
        tree = SuffixTrie(depth)
        for s in seqs:
            if trial % 2:
                tree.add(s)
            else:  # built a token at a time, as a request's own tree is
                active = []
                for t in s:
                    active = tree.extend(active, t)
        counts = _substring_counts(seqs, depth)
        assert tree.num_nodes == len(set(counts))
        context = [rng.randint(0, 3) for _ in range(rng.randint(1, 6))]
        k, factor, min_prob = rng.randint(1, 5), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4])
        got = tree.draft(context, k, factor, min_prob)
        want = _suffix_reference(counts, context, k, depth, factor, min_prob)
        assert got[0] == want[0] and got[1] == pytest.approx(want[1]), (seqs, context, depth, k, factor, min_prob)


def test_suffix_global_tree_is_bounded_and_evicts_the_oldest():
    from turbollm.spec_decode.suffix import SuffixProposer, SuffixTrie

    cfg = parse_speculative_config({"method": "suffix", "num_speculative_tokens": 4,
                                    "suffix_decoding_max_cached_requests": 3, "suffix_decoding_max_tree_depth": 5})
    p = SuffixProposer(cfg)
    rng = random.Random(8)
    outputs = [[rng.randint(0, 5) for _ in range(rng.randint(1, 12))] for _ in range(10)]
    for i, out in enumerate(outputs):
        p.propose(i, [9, 9] + out[:2], 2)  # a per-request tree comes and goes with its sequence
        p.finish(i, out)
        assert i not in p.requests
        fresh = SuffixTrie(5)
        for o in outputs[max(0, i - 2):i + 1]:
            fresh.add(o)
        assert p.global_tree.num_nodes == fresh.num_nodes == len(set(_substring_counts(outputs[max(0, i - 2):i + 1], 5)))
        assert _as_dict(p.global_tree.root) == _as_dict(fresh.root)
    # an earlier request's output drafts for a new one; the request's own tree drafts from its prompt
    q = SuffixProposer(parse_speculative_config({"method": "suffix", "num_speculative_tokens": 4}))
    q.finish(0, [10, 11, 12, 13, 14, 15])
    assert q.propose(1, [1, 2, 11, 12, 13], 4) == [14, 15]
    assert q.propose(2, [5, 6, 7, 8, 1, 5, 6, 7], 4) == [8, 1, 5]  # pattern 5 6 7 (3 tokens) -> at most 3


def _as_dict(node):
    return {t: (c.count, _as_dict(c)) for t, c in node.children.items()}


@pytest.mark.parametrize("value,field", [
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 1}, "max_tree_depth"),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_cached_requests": -1}, "cached_requests"),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_spec_factor": 0}, "spec_factor"),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 1.5}, "min_token_prob"),
    ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 0.5}, "only for suffix"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 2, "draft_vocab_size": 100}, "draft_vocab_size"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 2, "quantization": 4}, "'quantization'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int4"}, "only for draft_model"),
])
def test_suffix_config_errors_name_the_field(value, field):
    with pytest.raises(InvalidRequestError, match=field):
        parse_speculative_config(value)
