"""`turbollm bench kv`: KV policies and K/V storage dtypes side by side on one long prompt, same run.

Every setting (a `--kv-policy` × `--kv-cache-dtype` pair) builds an engine for one sequence of the
whole context (`max_num_seqs` 1, `max_model_len` = prompt + new tokens, the default KV budget for
that, so the pool is what the setting needs), prefills the first `ctx` tokens of WikiText-2 and
decodes `max_tokens` greedy tokens with their top-k logprobs (a second request on the cached
prompt; decode speed counts the steps after its first token, since what is left to prefill differs:
a quantized format caches only the blocks older than its recent window). Reported: the KV pool allocated; the peak K/V bytes in use during the prefill (its
chunks of `max_num_batched_tokens` new tokens are written before they attend, so a sliding layer
holds window + chunk there) and during the decodes at full context, each also per token of
context; prefill and decode speed; against the first setting, whether the tokens are equal and
the largest difference of a top-k logprob (over the ids both runs list at a step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

TOP_K = 5


@dataclass
class KVRun:
    policy: str
    kv_dtype: str
    ctx: int
    pool_bytes: int
    prefill_peak_bytes: int
    decode_peak_bytes: int
    groups: str  # the KV config's description (groups, blocks)
    prefill_s: float
    decode_s: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list, repr=False)

    def row(self, ref: "KVRun | None") -> dict[str, Any]:
        n = len(self.tokens)
        out: dict[str, Any] = {
            "policy": self.policy, "kv_dtype": self.kv_dtype, "ctx": self.ctx,
            "pool_MiB": _mib(self.pool_bytes), "prefill_peak_MiB": _mib(self.prefill_peak_bytes),
            "decode_peak_MiB": _mib(self.decode_peak_bytes),
            "decode_bytes_per_token": round(self.decode_peak_bytes / (self.ctx + n)),
            "prefill_tok_s": round(self.ctx / self.prefill_s, 1),
            "decode_tok_s": round((n - 1) / self.decode_s, 2) if n > 1 and self.decode_s > 0 else None,
        }
        if ref is not None:
            out["pool_vs_ref"] = round(ref.pool_bytes / self.pool_bytes, 2)
            out["prefill_peak_vs_ref"] = round(ref.prefill_peak_bytes / self.prefill_peak_bytes, 2)
            out["decode_peak_vs_ref"] = round(ref.decode_peak_bytes / self.decode_peak_bytes, 2)
            out["token_exact"] = self.tokens == ref.tokens  # a lossy policy (streaming) is not expected to be
            out["max_dlogprob"] = max_logprob_difference(self.logprobs, ref.logprobs, self.tokens, ref.tokens)
        return out


def _mib(n: int) -> float:
    return round(n / (1 << 20), 2)


def max_logprob_difference(a: list[dict[int, float]], b: list[dict[int, float]], tokens_a: list[int],
                           tokens_b: list[int]) -> float:
    """The largest |Δ logprob| over the ids both runs list at a step, up to and including the first step
    whose tokens differ (after it the two runs continue different texts)."""
    diff = 0.0
    for x, y, ta, tb in zip(a, b, tokens_a, tokens_b):
        for t in set(x) & set(y):
            diff = max(diff, abs(x[t] - y[t]))
        if ta != tb:
            break
    return float(f"{diff:.3g}")


def long_prompt(tokenizer, ctx: int, text: str) -> list[int]:
    """The first `ctx` tokens of `text`, encoding only a prefix of it (about 8 characters a token,
    doubled until it is enough), so a 4k prompt does not tokenize all of WikiText."""
    from turbollm.errors import BenchmarkError

    chars = 8 * ctx + 64
    while True:
        ids = tokenizer.encode(text[:chars])
        if len(ids) >= ctx + 16 or chars >= len(text):  # margin: the last few tokens may be a cut word's
            break
        chars *= 2
    if len(ids) < ctx:
        raise BenchmarkError(f"the text has {len(ids)} tokens, fewer than --ctx {ctx}")
    return ids[:ctx]


def run_setting(args, policy: str, kv_dtype: str, ctx: int, max_tokens: int, text: str) -> KVRun:
    from dataclasses import replace

    from turbollm import LLM, SamplingParams

    kw = {k: v for k, v in vars(replace(args, kv_policy=policy, kv_cache_dtype=kv_dtype, max_num_seqs=1,
                                        max_model_len=ctx + max_tokens, kv_cache_memory=None)).items()
          if k != "model"}
    llm = LLM(args.model, **kw)
    engine = llm.engine
    prompt = long_prompt(engine.tokenizer, ctx, text)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)
    prefill = time.perf_counter() - t0
    prefill_peak, engine.kv_manager.peak_bytes = engine.kv_manager.peak_bytes, 0
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_K)
    # the prompt is cached now (a quantized format: all but its recent window): a short prefill, then
    # the decodes, timed from the first token on (what is left to prefill differs between formats)
    out, decode = _timed_decode(engine, prompt, params)
    comp = out.outputs[0]
    return KVRun(policy, kv_dtype, ctx, engine.kv_config.total_bytes, prefill_peak, engine.kv_manager.peak_bytes,
                 engine.kv_config.describe(), prefill, decode, list(comp.token_ids),
                 [{t: lp.logprob for t, lp in step.items()} for step in comp.logprobs])


def _timed_decode(engine, prompt: list[int], params):
    """Run one request step by step: its final output and the seconds from its first token to its last."""
    rid = engine.add_request({"prompt_token_ids": prompt}, params)
    first, final = None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                final = out
    return final, time.perf_counter() - first
