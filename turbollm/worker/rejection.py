"""Verification of speculative drafts, beside the sampler: which of a sequence's drafts the target accepts,
and the sampling rows a verification step needs.

A step that verifies K drafts of a sequence samples K + 1 rows (its last token, then each draft): row j
as a decode of that position would sample it (its logits, its history with drafts 0..j-1, its noise).
The drafts are accepted while they equal the row's token; the row's token at the first difference (or
after the last draft) ends the step's tokens. The drafts come from the worker's proposer
(worker/drafter.py); the scheduler put them into the step (core/scheduler_spec.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from turbollm.handoff.runner_output import ModelRunnerOutput, SampledToken
from turbollm.worker.sampler import SamplingRow

if TYPE_CHECKING:
    from turbollm.worker.model_runner import SeqState


def verify_drafts(st: SeqState, results: list, drafts: list[int], out: ModelRunnerOutput) -> None:
    """One sequence's drafts against its rows' sampled tokens (`results`, row j's token as above).

    Greedy, the rows' argmaxes are the tokens decoding one at a time would give (rows are
    row-invariant up to 16 per step). Sampled, this is rejection sampling for a proposer whose
    draft d is a function of the tokens so far (q one-hot): the row's token x ~ p is accepted when
    x = d, with probability p(d) = min(1, p(d)/q(d)); otherwise x is p conditioned on x != d,
    which is norm(max(0, p - q)). A seeded request's noise is rewound to the rows used, so it
    draws the same tokens as without speculation."""
    c = st.num_computed_tokens
    tokens: list[SampledToken] = []
    for j, res in enumerate(results):
        if res.error is not None:
            out.errors[st.seq_id] = res.error
            return
        tokens.append(SampledToken(res.token_id, res.logprob, res.rank, res.top))
        if j == len(drafts) or res.token_id != drafts[j]:
            break
    st.token_ids[c + 1:] = [t.token_id for t in tokens]  # the accepted drafts, then the new token
    st.num_computed_tokens = c + len(tokens)
    out.sampled[st.seq_id] = tokens


def verify_rows(st: SeqState, num_drafts: int) -> list[SamplingRow]:
    """What the sampler sees of a speculating sequence's rows: row j follows the sequence so far and
    drafts 0..j-1 (a copy of that history only when the request's sampling depends on it)."""
    if not st.params.uses_history:
        return [st] * (num_drafts + 1)
    end = st.num_computed_tokens + 1
    return [SamplingRow(st.params, st.token_ids[:end + j], st.num_prompt_tokens, st.end_token_ids, st.generator)
            for j in range(num_drafts + 1)]


def draws_own_noise(st: SeqState) -> bool:
    return st.generator is not None and not st.params.greedy


def rewind(generator: torch.Generator, state: torch.Tensor, num_used: int, vocab: int) -> None:
    """Put a seeded request's generator where `num_used` rows' draws (one exponential per vocabulary
    entry each, as `Sampler._draw` draws them) would leave it."""
    generator.set_state(state)
    for _ in range(num_used):
        torch.empty(vocab).exponential_(generator=generator)
