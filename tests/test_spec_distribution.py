"""Distribution-exact speculation: tokens sampled with speculation follow the target's own sampling.

For each setting (T = 1; T = 0.7 with top-p 0.9; T = 1 with top-k 20; T = 1 with repetition,
presence and frequency penalties) the tiny model continues one prompt 20,000 times with
speculation and 20,000 times without, unseeded (the engines' own generators, seeded for a
repeatable run). The drafts come from an oracle proposer: after the first sampled token t1 it
proposes the target's greedy continuation of prompt + t1 (two tokens), which the target accepts
often (its top token carries 10-70% of the mass) and rejects often, so both branches of the
verification are exercised. The samples are compared as 3-token continuations (t1, t2, t3) by a
two-sample chi-square test of homogeneity at p = 0.01 (categories with fewer than 10 samples in
both runs together pooled into one). The same test, run against a sampler with a realistic bug
(each verification row sees every draft as history, so its penalties count drafts it has not
reached), must reject.
"""

from __future__ import annotations

import collections

import pytest
from conftest import drafter
import torch

from quant_tiny import build_tiny
from turbollm import LLM, SamplingParams
from turbollm.spec_decode.proposers import Proposer
from turbollm.worker import rejection

pytestmark = pytest.mark.slow  # statistical runs of thousands of samples: the full tier (`make test`), not `make test-fast`

SAMPLES = 20_000
PROMPT = {"prompt_token_ids": [5, 17, 230, 41, 99, 17, 230, 8, 64, 301, 17, 230]}
SETTINGS = {
    "T=1": dict(temperature=1.0),
    "T=0.7,top_p=0.9": dict(temperature=0.7, top_p=0.9),
    "T=1,top_k=20": dict(temperature=1.0, top_k=20),
    "T=1,penalties": dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
}
SPEC = {"method": "ngram", "num_speculative_tokens": 2, "adaptive": False}


class GreedyOracle(Proposer):
    """Drafts at the first decode only: the target's greedy two tokens after prompt + t1 (a table)."""

    def __init__(self, table: dict[int, list[int]], prompt_len: int):
        self.table, self.prompt_len = table, prompt_len
        self.calls = 0

    def propose(self, seq_id: int, token_ids: list[int], k: int) -> list[int]:
        if len(token_ids) != self.prompt_len + 1:
            return []
        self.calls += 1
        return self.table[token_ids[-1]][:k]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = str(build_tiny("qwen2", tmp_path_factory.mktemp("spec_dist")))
    kw = dict(kv_cache_memory=1 << 25, threads=2, seed=1234)
    # 5 sequences of 3 rows each stay within the 16 rows a step may verify
    plain, spec = LLM(path, **kw, max_num_seqs=256), LLM(path, **kw, max_num_seqs=5, speculative_config=SPEC)
    vocab = plain.engine.config.vocab_size
    firsts = [{"prompt_token_ids": PROMPT["prompt_token_ids"] + [t]} for t in range(vocab)]
    outs = plain.generate(firsts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    oracle = GreedyOracle({t: o.outputs[0].token_ids for t, o in enumerate(outs)}, len(PROMPT["prompt_token_ids"]))
    drafter(spec).proposer = oracle
    return plain, spec, oracle


def _continuations(llm: LLM, setting: dict) -> collections.Counter:
    params = SamplingParams(max_tokens=4, ignore_eos=True, **setting)
    outs = llm.generate([PROMPT] * SAMPLES, params, use_tqdm=False)
    return collections.Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)


def chi_square_p(a: collections.Counter, b: collections.Counter, min_count: int = 10) -> tuple[float, int]:
    """p-value of the two-sample chi-square test that `a` and `b` come from one distribution, and the
    number of categories (those with fewer than `min_count` samples in a and b together pooled)."""
    keys = set(a) | set(b)
    big = [k for k in keys if a[k] + b[k] >= min_count]
    rows = [[a[k], b[k]] for k in big]
    pooled = [sum(a[k] for k in keys if k not in big), sum(b[k] for k in keys if k not in big)]
    if sum(pooled):
        rows.append(pooled)
    obs = torch.tensor(rows, dtype=torch.float64)
    expected = obs.sum(1, keepdim=True) * obs.sum(0, keepdim=True) / obs.sum()
    stat = ((obs - expected) ** 2 / expected).sum()
    dof = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2)), len(rows)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculative_sampling_matches_the_targets_distribution(engines, name):
    plain, spec, oracle = engines
    before = dict(spec.engine.scheduler.spec_counts)
    with_spec, alone = _continuations(spec, SETTINGS[name]), _continuations(plain, SETTINGS[name])
    counts = spec.engine.scheduler.spec_counts
    drafted = counts["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = counts["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert drafted >= SAMPLES and 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)  # both branches
    p, categories = chi_square_p(with_spec, alone)
    assert categories >= 50, categories
    assert p > 0.01, f"{name}: with speculation vs without, chi-square p = {p:.2g} over {categories} categories"


def test_the_test_detects_a_sampler_that_sees_drafts_it_has_not_reached(engines, monkeypatch):
    """Control: verification rows whose penalties count every draft of the step (a history bug)."""
    plain, spec, _ = engines
    monkeypatch.setattr(rejection, "verify_rows", lambda st, num_drafts: [st] * (num_drafts + 1))
    setting = SETTINGS["T=1,penalties"]
    p, categories = chi_square_p(_continuations(spec, setting), _continuations(plain, setting))
    assert p < 0.01, f"the broken sampler passed: p = {p:.2g} over {categories} categories"
