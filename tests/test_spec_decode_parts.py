"""Speculative decoding's parts outside the engine core (turbollm/spec_decode): the configuration's
checks (vLLM's field names, an error naming the field for every bad value) and the n-gram proposer
against a brute-force reference."""

from __future__ import annotations

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
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], 1) == [4]
    assert p.propose([1, 2, 3, 4], 3) == []  # no repeat
    assert p.propose([7, 8, 9, 7, 8, 1, 7, 8], 2) == [1, 7]  # the most recent earlier "7 8" (at 3)
    assert p.propose([5, 6, 5, 6], 4) == [5, 6]  # continuation cut at the sequence's end
    assert p.propose([], 3) == [] and p.propose([4], 3) == []
    assert make_proposer(SpeculativeConfig("ngram", 2)).propose([1, 2, 1, 2], 2) == [1, 2]
    with pytest.raises(NotImplementedError, match="suffix"):
        make_proposer(SpeculativeConfig("suffix", 2))


def test_ngram_proposer_matches_brute_force():
    rng = random.Random(3)
    for _ in range(2000):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 7)
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(0, 30))]
        got = NgramProposer(SpeculativeConfig("ngram", k, lo, hi)).propose(tokens, k)
        assert got == _ngram_reference(tokens, k, lo, hi), (tokens, k, lo, hi)
