"""Adaptive speculation (turbollm/spec_decode/adaptive.py): the plan against brute force, K = 0 where
speculation does not pay, the cost line, the acceptance estimate, the start-up profile, and the engine
with adaptive K still token-exact."""

from __future__ import annotations

import itertools
import random

import pytest

from quant_tiny import build_tiny
from turbollm import LLM, SamplingParams
from turbollm.spec_decode.adaptive import PROBE_EVERY, Acceptance, AdaptivePlanner, StepCosts
from test_spec_decode import _prompts, _tokens


def _planner(a: float, b: float, draft: float, rates: dict[int, list[float]], max_k: int = 4) -> AdaptivePlanner:
    p = AdaptivePlanner(max_k, 16)
    for r in (1, 16):
        p.costs.observe(r, a + b * r)
    p.costs.draft_seconds = draft
    p.acceptance.rates = lambda sid: rates[sid]
    return p


def _throughput(ks: dict[int, int], rates, base_rows, a, b, draft) -> float:
    tokens = len(ks)
    for sid, k in ks.items():
        reach = 1.0
        for j in range(k):
            reach *= rates[sid][j]
            tokens += reach
    drafts = sum(ks.values())
    return tokens / (a + b * (base_rows + drafts) + draft * drafts)


def test_plan_is_the_best_split_of_drafts():
    """Greedy by the next draft's acceptance chance is optimal (gains fall along a sequence's drafts,
    each draft costs the same): equal to brute force over every split."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 3)
        rates = {sid: sorted((rng.uniform(0.05, 0.95) for _ in range(4)), reverse=True) for sid in range(n)}
        a, b, draft = rng.uniform(0.01, 0.05), rng.uniform(0.0, 0.02), rng.choice([0.0, rng.uniform(0.0, 0.03)])
        limits = {sid: rng.randint(0, 4) for sid in range(n)}
        ks = _planner(a, b, draft, rates).plan(limits, n)
        best = max(_throughput(dict(zip(limits, c)), rates, n, a, b, draft)
                   for c in itertools.product(*(range(limits[s] + 1) for s in limits)))
        assert all(ks[s] <= limits[s] for s in limits)
        assert _throughput(ks, rates, n, a, b, draft) == pytest.approx(best, rel=1e-9), (ks, limits)


def test_k_falls_to_zero_when_speculation_does_not_pay():
    rates = {0: [0.9] * 4, 1: [0.9] * 4}
    assert _planner(0.05, 0.0005, 0.0, rates).plan({0: 4, 1: 4}, 2) == {0: 4, 1: 4}  # rows nearly free
    assert _planner(0.0, 0.05, 0.0, rates).plan({0: 4, 1: 4}, 2) == {0: 0, 1: 0}  # a row costs a token's step
    assert _planner(0.05, 0.0005, 0.06, rates).plan({0: 4}, 1) == {0: 0}  # a draft dearer than a step
    low = {0: [0.05] * 4}
    p = _planner(0.05, 0.005, 0.0, low)
    plans = [p.plan({0: 4}, 1)[0] for _ in range(2 * PROBE_EVERY)]
    assert plans.count(0) == 2 * PROBE_EVERY - 2 and plans[PROBE_EVERY - 1] == 1  # probes, to measure again


def test_cost_line_and_acceptance_estimates():
    c = StepCosts(16)
    assert c.line() == (0.0, 0.0)
    for r in (1, 2, 4, 8, 16):
        c.observe(r, 0.05 + 0.01 * r)
    a, b = c.line()
    assert a == pytest.approx(0.05) and b == pytest.approx(0.01)
    c.observe_draft(4, 0.08)
    assert c.draft_seconds == pytest.approx(0.02)
    acc = Acceptance(3)
    for _ in range(40):
        acc.record(7, 3, 1)  # draft 0 always accepted, draft 1 never
    r7, r8 = acc.rates(7), acc.rates(8)
    assert r7[0] > 0.9 and r7[1] < 0.1 and r7[2] == pytest.approx(r8[2])  # position 2 never reached
    assert r8[0] > 0.9  # a new sequence starts from everyone's rates
    acc.forget(7)
    assert acc.rates(7) == r8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny("qwen2", tmp_path_factory.mktemp("adaptive")))


def test_engine_profiles_costs_at_start_and_stays_token_exact(tiny):
    spec = LLM(tiny, kv_cache_memory=1 << 22, threads=2,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    planner = spec.engine.scheduler.planner
    assert planner is not None and sorted(planner.costs.weights) == [1, 2, 4, 8, 16]  # the start-up profile
    assert spec.engine.kv_manager.num_used == 0 and not spec.engine.requests  # the scratch requests are done
    assert spec.engine.stats()["num_steps"] == 0  # (and not counted as the engine's steps)
    plain = LLM(tiny, kv_cache_memory=1 << 22, threads=2)
    prompts = _prompts(6)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert _tokens(spec, prompts, greedy) == _tokens(plain, prompts, greedy)
    assert set(spec.engine.executor.worker.runner.states) <= {s.seq_id for s in spec.engine.scheduler.seqs.values()} \
        | set(spec.engine.scheduler._finished_ids)  # the workers dropped the scratch requests too
    assert sum(planner.costs.weights.values()) > 15  # the steps that ran refined the line
    fixed = LLM(tiny, kv_cache_memory=1 << 22, threads=2, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    assert fixed.engine.scheduler.planner is None
