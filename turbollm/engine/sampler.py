"""The sampler: logits → next tokens, per-request parameters applied row by row.

Order: penalties (repetition, presence, frequency) and `logit_bias` on the raw logits, `min_tokens`
(end tokens masked), temperature, top-k, top-p, min-p, then a draw from each request's own
generator (seeded requests give the same tokens whatever else is in the batch). Greedy
requests take the argmax. Logprobs are those of the raw model distribution (before any
of the above), as vLLM reports them.

One row's numbers never fail the batch: a NaN produced by extreme settings (a penalty of
1e308 overflows float32) counts as an excluded token, a row with nothing left to draw from
takes the argmax of its raw logits, and an exception while sampling a row is returned in
that row's `SampleResult.error` for the engine to fail that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turbollm.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_id: int
    logprob: float  # raw-distribution logprob of the token (0.0 when logprobs were not asked for)
    rank: int  # 1-based rank in the raw distribution (0 when not asked for)
    top: list[tuple[int, float]]  # the top-k (id, logprob) when asked for
    error: str | None = None  # sampling this row raised: the engine fails its request


def token_rank(logprobs: torch.Tensor, token: int) -> int:
    """1 + the number of tokens strictly more likely than `token` (logprobs: [V])."""
    return int((logprobs > logprobs[token]).sum().item()) + 1


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.all_token_ids)), dtype=torch.int64)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        ids, counts = torch.tensor(seq.output_token_ids, dtype=torch.int64).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    return logits


def _filter(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        drop = cum - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        drop[0] = False
        logits = logits.scatter(0, order[drop], float("-inf"))
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def _draw(logits: torch.Tensor, raw: torch.Tensor, seq: Sequence, gen: torch.Generator) -> int:
    """A token from the filtered distribution of one row; the raw argmax when nothing is left to draw."""
    logits = torch.nan_to_num(logits, nan=float("-inf"))
    probs = _filter(logits, seq).softmax(-1)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        return int(torch.argmax(torch.nan_to_num(raw, nan=float("-inf"))).item())
    return int(torch.multinomial(probs, 1, generator=gen).item())


class Sampler:
    def __init__(self, seed: int | None = None):
        self.default_generator = torch.Generator()
        if seed is not None:
            self.default_generator.manual_seed(seed)
        else:  # a fresh seed for this generator only (torch.seed() would reseed the process-wide RNG)
            self.default_generator.seed()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], end_token_ids: list[set[int]]) -> list[SampleResult]:
        """One token for each row of `logits` [B, V] (row i belongs to seqs[i])."""
        logits = logits.float()
        want = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[want], dim=-1) if want else None
        row_of = {i: r for r, i in enumerate(want)}
        results = []
        for i, seq in enumerate(seqs):
            try:
                results.append(self._sample_row(logits[i], seq, end_token_ids[i],
                                                raw_logprobs[row_of[i]] if i in row_of else None))
            except Exception as e:  # noqa: BLE001 - this row's request fails, the batch goes on
                results.append(SampleResult(-1, 0.0, 0, [], error=f"{type(e).__name__}: {e}"))
        return results

    def _sample_row(self, raw: torch.Tensor, seq: Sequence, end_ids: set[int],
                    lp: torch.Tensor | None) -> SampleResult:
        p = seq.params
        row = _apply_penalties(raw.clone(), seq)
        if len(seq.output_token_ids) < p.min_tokens and end_ids:
            row[torch.tensor(sorted(end_ids))] = float("-inf")
        if p.greedy:
            token = int(torch.argmax(torch.nan_to_num(row, nan=float("-inf"))).item())
        else:
            token = _draw(row, raw, seq, seq.generator or self.default_generator)
        if lp is None:  # logprobs are computed only for requests that ask for them
            return SampleResult(token, 0.0, 0, [])
        top: list[tuple[int, float]] = []
        if p.logprobs:
            vals, idx = torch.topk(lp, min(p.logprobs, lp.numel()))
            top = list(zip(idx.tolist(), vals.tolist()))
        return SampleResult(token, float(lp[token]), token_rank(lp, token), top)
