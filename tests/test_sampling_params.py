"""SamplingParams validation and the sampler's filters, without a model."""

from __future__ import annotations

import pytest
import torch

from turbollm.engine.sampler import Sampler
from turbollm.engine.sequence import Sequence
from turbollm.errors import InvalidRequestError
from turbollm.sampling_params import SamplingParams


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


def _seq(params: SamplingParams, outputs=()) -> Sequence:
    s = Sequence(0, "r", 0, [1, 2, 3], params)
    s.output_token_ids = list(outputs)
    return s


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(seed=0)
    for params, allowed in [(SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.7), {0, 1}),
                            (SamplingParams(min_p=0.5), {0, 1}), (SamplingParams(top_p=0.45), {0})]:
        seen = {sampler.sample(logits, [_seq(params)], [set()])[0].token_id for _ in range(200)}
        assert seen == allowed, (params, seen)


def test_min_tokens_masks_end_tokens_and_penalties_apply():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    sampler = Sampler(seed=0)
    r = sampler.sample(logits, [_seq(SamplingParams(temperature=0, min_tokens=2, max_tokens=4))], [{0}])[0]
    assert r.token_id != 0
    # a strong frequency penalty on token 0 (generated 3 times) moves greedy away from it
    r = sampler.sample(logits, [_seq(SamplingParams(temperature=0, frequency_penalty=2.0), [0, 0, 0])], [set()])[0]
    assert r.token_id != 0
    # repetition penalty divides positive logits of seen tokens (prompt tokens 1, 2 included)
    logits = torch.tensor([[0.0, 3.0, 2.9, 2.0, 2.0]])
    r = sampler.sample(logits, [_seq(SamplingParams(temperature=0, repetition_penalty=2.0))], [set()])[0]
    assert r.token_id == 4


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    mk = lambda: _seq(SamplingParams(temperature=1.0, seed=11))  # noqa: E731
    alone = []
    for _ in range(5):
        s = mk()
        s.generator = torch.Generator().manual_seed(11)
        alone.append(Sampler().sample(logits[1:2], [s], [set()])[0].token_id)
    s = mk()
    s.generator = torch.Generator().manual_seed(11)
    others = [_seq(SamplingParams(temperature=1.0)), _seq(SamplingParams(temperature=1.0))]
    batched = [Sampler().sample(logits, [others[0], s, others[1]], [set()] * 3)[1].token_id]
    assert batched[0] == alone[0]
