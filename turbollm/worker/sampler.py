"""The sampler: logits → next tokens for a whole batch in one pass of tensor ops.

Order: penalties (repetition on every token seen, presence and frequency on the output) and
`logit_bias` on the raw logits, `min_tokens` (end tokens masked), then greedy rows take the
argmax; the others are divided by their temperature and filtered by top-k, top-p and min-p
(one sort serves both), and draw by the exponential race: token = argmax(p / E) with E ~ Exp(1)
per token, which samples from p. A seeded row draws its noise from its own generator, so its
tokens do not depend on what else is in the batch; the others share the sampler's generator.
Logprobs are those of the raw model distribution (before any of the above), as vLLM reports them.

One row's numbers never fail the batch: NaN (a penalty of 1e308 overflows float32) counts as
an excluded token, and a row with nothing left to draw from takes the argmax of its raw logits.
If the batched pass raises anyway, each row is sampled alone, so an exception is pinned on the
row that caused it (`SampleResult.error`) and the engine fails that request only.
`sample_reference` is the plain row-by-row version the tests hold the batched pass to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from turbollm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """What the sampler needs of one sequence (a worker's per-sequence state has these fields)."""

    params: SamplingParams
    token_ids: list[int]  # the prompt, then the tokens generated so far
    num_prompt_tokens: int
    end_token_ids: Sequence[int] = ()  # masked while fewer than min_tokens were generated
    generator: torch.Generator | None = None  # a seeded request's own

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class SampleResult:
    token_id: int
    logprob: float  # raw-distribution logprob of the token (0.0 when logprobs were not asked for)
    rank: int  # 1-based rank in the raw distribution (0 when not asked for)
    top: list[tuple[int, float]] = field(default_factory=list)  # the top-k (id, logprob) when asked for
    error: str | None = None  # sampling this row raised: the engine fails its request


def ranked_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int
                    ) -> tuple[list[float], list[int], list[list[tuple[int, float]]]]:
    """For each row of `logits` [R, V] and its token: the token's logprob, its 1-based rank (1 + the
    tokens strictly more likely) and the row's top k (id, logprob) (empty lists when k = 0)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(list(tokens), dtype=torch.int64).unsqueeze(1))
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if k:
        vals, idx = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        top = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return chosen[:, 0].tolist(), ranks, top


class Sampler:
    def __init__(self, seed: int | None = None):
        self.default_generator = torch.Generator()
        if seed is not None:
            self.default_generator.manual_seed(seed)
        else:  # a fresh seed for this generator only (torch.seed() would reseed the process-wide RNG)
            self.default_generator.seed()

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampleResult]:
        """One token for each row of `logits` [B, V] (row i belongs to rows[i])."""
        if not rows:
            return []
        drawing = [r.generator for r in rows if r.generator is not None and not r.params.greedy]
        saved = [(g, g.get_state()) for g in drawing + [self.default_generator]]
        try:
            return self._sample_batch(logits, rows)
        except Exception:  # noqa: BLE001 - find the row that fails; the others still get their token
            for g, state in saved:  # the failed pass may have drawn noise: draw it again, the same
                g.set_state(state)
            results = []
            for i, row in enumerate(rows):
                try:
                    results.append(self._sample_batch(logits[i:i + 1], [row])[0])
                except Exception as e:  # noqa: BLE001
                    results.append(SampleResult(-1, 0.0, 0, [], error=f"{type(e).__name__}: {e}"))
            return results

    # ------------------------------------------------------------------ the batched pass
    def _sample_batch(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampleResult]:
        raw = logits.float()
        if all(_plain_greedy(r) for r in rows):
            # nothing to apply before the argmax: no copy of the logits, no NaN pass over them. `max` (one
            # vectorized pass, values and first indices; torch's CPU argmax is several times slower) returns NaN
            # for a row holding one, so rows without a NaN maximum have none and their index is the masked
            # argmax; a batch with a NaN row takes the general path below
            picked, tokens = raw.max(dim=-1)
            if not bool(picked.isnan().any()):
                return _with_logprobs(raw, tokens.tolist(), rows)
        x = apply_penalties_and_masks(raw.clone(), rows)
        x.masked_fill_(x.isnan(), _NEG_INF)
        tokens = torch.argmax(x, dim=-1)
        drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
        if drawn:
            tokens[drawn] = self._draw(x[drawn], raw[drawn], [rows[i] for i in drawn])
        return _with_logprobs(raw, tokens.tolist(), rows)

    def _draw(self, x: torch.Tensor, raw: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Tokens drawn from the filtered distributions of the rows of `x` (penalized logits)."""
        probs = filtered_probs(x, [r.params for r in rows])
        noise = torch.empty_like(probs)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1]).exponential_(generator=self.default_generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        tokens = torch.argmax(probs / noise.clamp_(min=1e-30), dim=-1)
        bad = ~(torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0))
        if bool(bad.any()):  # nothing left to draw from: the raw argmax
            tokens[bad] = torch.argmax(raw[bad].masked_fill(raw[bad].isnan(), _NEG_INF), dim=-1)
        return tokens


def _plain_greedy(r: SamplingRow) -> bool:
    """Greedy with nothing applied to the logits first (no penalty, bias or min_tokens mask)."""
    p = r.params
    return (p.greedy and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and not p.logit_bias and not (r.end_token_ids and len(r.token_ids) - r.num_prompt_tokens < p.min_tokens))


def _flat(rows_ids: list[tuple[int, Sequence[int]]], vocab: int) -> torch.Tensor:
    """Flat indices row * vocab + token for (row, token ids) pairs."""
    parts = [torch.as_tensor(list(ids), dtype=torch.int64) + r * vocab for r, ids in rows_ids if len(ids)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def apply_penalties_and_masks(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, presence and frequency penalties, logit_bias and the min_tokens mask on `x` [B, V] (in place)."""
    B, V = x.shape
    flat = x.view(-1)
    rep = [(i, r) for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        seen = torch.zeros(B * V, dtype=torch.bool)
        seen[_flat([(i, r.token_ids) for i, r in rep], V)] = True
        penalty = torch.ones(B, 1)
        penalty[[i for i, _ in rep], 0] = torch.tensor([r.params.repetition_penalty for _, r in rep])
        seen = seen.view(B, V)
        x.copy_(torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x))
    pf = [(i, r) for i, r in enumerate(rows) if (r.params.presence_penalty or r.params.frequency_penalty)
          and len(r.token_ids) > r.num_prompt_tokens]
    if pf:
        counts = torch.bincount(_flat([(i, r.output_token_ids) for i, r in pf], V), minlength=B * V).view(B, V)
        freq, pres = torch.zeros(B, 1), torch.zeros(B, 1)
        idx = [i for i, _ in pf]
        freq[idx, 0] = torch.tensor([r.params.frequency_penalty for _, r in pf])
        pres[idx, 0] = torch.tensor([r.params.presence_penalty for _, r in pf])
        counts = counts.to(x.dtype)
        x.sub_(torch.where(counts > 0, freq * counts + pres, torch.zeros(())))
    bias = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if bias:
        flat.index_add_(0, _flat([(i, list(b)) for i, b in bias], V),
                        torch.tensor([v for _, b in bias for v in b.values()], dtype=x.dtype))
    ends = [(i, list(r.end_token_ids)) for i, r in enumerate(rows)
            if r.end_token_ids and len(r.token_ids) - r.num_prompt_tokens < r.params.min_tokens]
    if ends:
        flat[_flat(ends, V)] = _NEG_INF
    return x


def filtered_probs(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """softmax(x / temperature) restricted by each row's top-k, top-p and min-p ([B, V] → [B, V])."""
    B, V = x.shape
    temp = torch.tensor([p.temperature for p in params], dtype=x.dtype).unsqueeze(1)
    y = x / temp
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype).unsqueeze(1)
    if bool((top_k < V).any()) or bool((top_p < 1).any()):
        sv, order = torch.sort(y, dim=-1, descending=True)
        kth = sv.gather(1, (top_k - 1).unsqueeze(1))
        sv = sv.masked_fill(sv < kth, _NEG_INF)  # top-k, ties at the k-th value kept
        probs = sv.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (rows without top-p drop nothing: their
        # cumulative sum may round past 1.0 in float32)
        drop = ((probs.cumsum(-1) - probs) > top_p) & (top_p < 1)
        drop[:, 0] = False
        sv = sv.masked_fill(drop, _NEG_INF)
        y = torch.empty_like(y).scatter_(1, order, sv)
    min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype).unsqueeze(1)
    if bool((min_p > 0).any()):
        probs = y.softmax(-1)
        y = y.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, _NEG_INF)
    return y.softmax(-1)


def _with_logprobs(raw: torch.Tensor, tokens: list[int], rows: Sequence[SamplingRow]) -> list[SampleResult]:
    """The results, with raw-distribution logprobs, rank and top k for the rows that ask for them."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    results = [SampleResult(t, 0.0, 0, []) for t in tokens]
    if not want:
        return results
    k_max = max(rows[i].params.logprobs for i in want)
    chosen, ranks, top = ranked_logprobs(raw[want], [tokens[i] for i in want], k_max)
    for j, i in enumerate(want):
        results[i] = SampleResult(tokens[i], chosen[j], ranks[j], top[j][:rows[i].params.logprobs])
    return results


def sample_reference(logits: torch.Tensor, rows: Sequence[SamplingRow], noise_generators=None) -> list[int]:
    """Plain per-row sampling with the same rules (penalties, masks, filters, exponential race), for
    tests: `noise_generators[i]` draws row i's noise (each row alone, as `Sampler` does for seeded rows)."""
    out = []
    for i, r in enumerate(rows):
        p = r.params
        row = logits[i].float().clone()
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.int64)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        outs = r.output_token_ids
        if (p.presence_penalty or p.frequency_penalty) and outs:
            ids, counts = torch.tensor(outs, dtype=torch.int64).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
        for t, b in (p.logit_bias or {}).items():
            row[t] += b
        if r.end_token_ids and len(outs) < p.min_tokens:
            row[torch.tensor(sorted(r.end_token_ids))] = _NEG_INF
        row = torch.where(row.isnan(), torch.full_like(row, _NEG_INF), row)
        if p.greedy:
            out.append(int(torch.argmax(row)))
            continue
        row = row / p.temperature
        if p.top_k and p.top_k < row.numel():
            row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], _NEG_INF)
        if p.top_p < 1.0:
            sorted_row, order = torch.sort(row, descending=True)
            probs = sorted_row.softmax(-1)
            drop = probs.cumsum(-1) - probs > p.top_p
            drop[0] = False
            row = row.scatter(0, order[drop], _NEG_INF)
        if p.min_p > 0:
            probs = row.softmax(-1)
            row = row.masked_fill(probs < p.min_p * probs.max(), _NEG_INF)
        probs = row.softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=noise_generators[i]).clamp_(min=1e-30)
        out.append(int(torch.argmax(probs / noise)))
    return out
