"""SamplingParams validation and the sampler's filters, without a model."""

from __future__ import annotations

import pytest
import torch

from turbollm.errors import InvalidRequestError
from turbollm.sampling_params import SamplingParams
from turbollm.worker.sampler import Sampler, SamplingRow


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"stop": 5}, "stop"), ({"stop": [""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"), ({"top_k": -2}, "top_k"), ({"min_p": 2.0}, "min_p"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"), ({"logprobs": -1}, "logprobs"),
    ({"temperature": "hot"}, "temperature"), ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"stop_token_ids": ["a"]}, "stop_token_ids"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)
    assert issubclass(InvalidRequestError, ValueError)


def _row(params: SamplingParams, outputs=(), ends=(), seed: int | None = None) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, [1, 2, 3] + list(outputs), 3, list(ends), gen)


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(seed=0)
    for params, allowed in [(SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.7), {0, 1}),
                            (SamplingParams(min_p=0.5), {0, 1}), (SamplingParams(top_p=0.45), {0})]:
        seen = {sampler.sample(logits, [_row(params)])[0].token_id for _ in range(200)}
        assert seen == allowed, (params, seen)


def test_min_tokens_masks_end_tokens_and_penalties_apply():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    sampler = Sampler(seed=0)
    r = sampler.sample(logits, [_row(SamplingParams(temperature=0, min_tokens=2, max_tokens=4), ends=[0])])[0]
    assert r.token_id != 0
    # a strong frequency penalty on token 0 (generated 3 times) moves greedy away from it
    r = sampler.sample(logits, [_row(SamplingParams(temperature=0, frequency_penalty=2.0), [0, 0, 0])])[0]
    assert r.token_id != 0
    # repetition penalty divides positive logits of seen tokens (prompt tokens 1, 2 included)
    logits = torch.tensor([[0.0, 3.0, 2.9, 2.0, 2.0]])
    r = sampler.sample(logits, [_row(SamplingParams(temperature=0, repetition_penalty=2.0))])[0]
    assert r.token_id == 4


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, seed=11)
    alone = [Sampler().sample(logits[1:2], [_row(params, seed=11)])[0].token_id for _ in range(5)]
    others = [_row(SamplingParams(temperature=1.0)), _row(SamplingParams(temperature=1.0))]
    batched = Sampler().sample(logits, [others[0], _row(params, seed=11), others[1]])[1].token_id
    assert len(set(alone)) == 1 and batched == alone[0]


def _random_rows(n: int, vocab: int, g: torch.Generator) -> list[SamplingRow]:
    """Rows with every kind of setting the sampler applies, drawn at random (each with its own seed)."""
    rows = []
    for i in range(n):
        pick = lambda choices: choices[int(torch.randint(len(choices), (1,), generator=g))]  # noqa: E731
        outputs = torch.randint(vocab, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
        params = SamplingParams(
            temperature=pick([0.0, 0.7, 1.0, 1.5]), top_k=pick([0, 1, 3, 20]), top_p=pick([1.0, 0.9, 0.5]),
            min_p=pick([0.0, 0.05]), repetition_penalty=pick([1.0, 1.3, 0.8]), presence_penalty=pick([0.0, 0.5]),
            frequency_penalty=pick([0.0, -0.4, 1.0]), min_tokens=pick([0, 3, 9]), seed=1000 + i,
            logit_bias=pick([None, {5: 3.0, 7: -100.0}]))
        rows.append(SamplingRow(params, [1, 2, 3] + outputs, 3, pick([[], [0, 4]]), None))
    return rows


def test_batched_sampler_equals_the_row_by_row_reference():
    """The batched pass (one set of tensor ops for the whole batch) picks exactly the tokens of the plain
    per-row reference, given the same noise per row: 64 random rows over greedy and sampled settings,
    penalties, logit_bias, min_tokens masks and all filters."""
    from turbollm.worker.sampler import sample_reference

    g = torch.Generator().manual_seed(7)
    for trial in range(4):
        rows = _random_rows(64, 40, g)
        logits = torch.randn(64, 40, generator=g) * 3
        for i, r in enumerate(rows):
            r.generator = torch.Generator().manual_seed(r.params.seed)
        got = [res.token_id for res in Sampler().sample(logits, rows)]
        want = sample_reference(logits, rows, [torch.Generator().manual_seed(r.params.seed) for r in rows])
        assert got == want, trial


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(temperature=0, logprobs=2, repetition_penalty=5.0)
    r = Sampler().sample(logits, [SamplingRow(params, [0, 0], 1)])[0]
    raw = torch.log_softmax(logits[0], -1)
    assert r.token_id == 1 and r.rank == 2  # the penalty moved greedy off token 0; rank is in the raw distribution
    assert r.logprob == pytest.approx(float(raw[1]))
    assert [t for t, _ in r.top] == [0, 1] and r.top[0][1] == pytest.approx(float(raw[0]))


def test_rows_without_top_p_keep_every_token_beside_rows_with_it():
    """Before: with one row of the batch using top-p, a row without it went through the cumulative sum too,
    whose float32 rounding past 1.0 dropped hundreds of its tail tokens (a dependence on the batch)."""
    from turbollm.worker.sampler import filtered_probs

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 49152, generator=g) * 4
    probs = filtered_probs(x, [SamplingParams(top_p=0.5), SamplingParams(top_p=1.0)])
    assert bool((probs[1] > 0).all())
    assert torch.allclose(probs[1], x[1].softmax(-1))
    assert int((probs[0] > 0).sum()) < 49152


def test_plain_greedy_rows_skip_the_copy_and_still_exclude_nan():
    """Plain greedy rows take the argmax of the logits as they are; a row holding NaN still excludes it (the
    general path), and a batch mixing plain and penalized greedy rows equals the reference."""
    from turbollm.worker.sampler import sample_reference

    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0], [float("nan"), 0.1, 3.0, 0.2], [1.0, 4.0, 4.5, 0.0]])
    plain = SamplingParams(temperature=0)
    rows = [SamplingRow(plain, [0, 1], 1), SamplingRow(plain, [0, 1], 1),
            SamplingRow(SamplingParams(temperature=0, repetition_penalty=2.0), [0, 2], 1)]
    got = [r.token_id for r in Sampler().sample(logits, rows)]
    assert got == [1, 2, 1] == sample_reference(logits, rows, [None] * 3)
    assert [r.token_id for r in Sampler().sample(logits[:1], rows[:1])] == [1]
    nan_row = torch.full((1, 4), float("nan"))  # nothing to draw from: the general path's raw argmax rule
    assert Sampler().sample(nan_row, [rows[0]])[0].token_id == sample_reference(nan_row, [rows[0]], [None])[0]
