"""Long-context evaluation on the serving path: streaming perplexity by position, and the passkey probe.

Both run through an `LLM` (the engine, its scheduler, its KV policy and K/V storage), so what a KV
policy or K/V format keeps or drops is what gets scored:

- `stream_score`: one request whose prompt is `n` tokens of a long text (WikiText-2's test split,
  concatenated), with `prompt_logprobs=0`, so the engine returns log p(token i | tokens < i) for every
  position as its chunked prefill goes (a policy that releases or evicts K/V does so between chunks,
  as it would while serving). Reported: perplexity over every scored token and by position bucket,
  and the K/V memory (peak bytes in use, and per token of context). Several consecutive segments of
  the text, each its own request, are pooled position by position (`merge_segments`).
- `passkey`: a number hidden at a chosen depth of filler text, asked for at the end; greedy
  decoding must produce it. Accuracy by context length and depth, over `trials` random keys each.
  The filler is our own plain sentences, repeated; the key line and the question follow the
  common passkey-retrieval setup (a 5-digit number, said twice).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

FILLER = ("The river runs past the old mill and on toward the hills. Boats go up in the morning and come "
          "back at night. ")
KEY_LINE = "Remember this: the secret number is {key}. The secret number is {key}. "
QUESTION = "What is the secret number? The secret number is"


@dataclass
class StreamResult:
    tokens: int  # positions scored (every one after the first)
    nll: list[float] = field(repr=False, default_factory=list)  # -log p per scored position (position 1..)
    peak_kv_bytes: int = 0
    kv_pool_bytes: int = 0

    @property
    def ppl(self) -> float:
        return math.exp(sum(self.nll) / len(self.nll))

    def by_position(self, bucket: int) -> list[tuple[int, int, float]]:
        """(first position, last position, perplexity) of each bucket of `bucket` scored positions."""
        out = []
        for start in range(0, len(self.nll), bucket):
            part = self.nll[start:start + bucket]
            out.append((start + 1, start + len(part), math.exp(sum(part) / len(part))))
        return out

    def summary(self, bucket: int) -> dict[str, Any]:
        n = self.tokens + 1
        return {"tokens": n, "ppl": round(self.ppl, 4), "peak_kv_MiB": round(self.peak_kv_bytes / (1 << 20), 2),
                "kv_bytes_per_token": round(self.peak_kv_bytes / n), "kv_pool_MiB": round(self.kv_pool_bytes / (1 << 20), 2),
                "ppl_by_position": [[a, b, round(p, 4)] for a, b, p in self.by_position(bucket)]}


def stream_score(llm, ids: list[int]) -> StreamResult:
    """Score `ids` as one request through the engine (`prompt_logprobs=0`: each position's own token)."""
    from turbollm import SamplingParams

    engine = llm.engine
    engine.kv_manager.peak_bytes = 0
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    if out.prompt_logprobs is None or len(out.prompt_logprobs) != len(ids):
        from turbollm.eval.perplexity import EvalError

        raise EvalError(f"the engine did not score the stream: {out.outputs[0].finish_reason} "
                        f"({getattr(out, 'error', None)})")
    nll = []
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        nll.append(-entry[ids[pos]].logprob)
    return StreamResult(len(nll), nll, engine.kv_manager.peak_bytes, engine.kv_config.total_bytes)


def merge_segments(results: list[StreamResult]) -> StreamResult:
    """Several streams of the same length (consecutive segments of the text) as one: each position's
    -log p averaged over the segments (so the perplexity is over every scored token), the largest peak."""
    nll = [sum(col) / len(col) for col in zip(*(r.nll for r in results))]
    return StreamResult(results[0].tokens, nll, max(r.peak_kv_bytes for r in results), results[0].kv_pool_bytes)


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """Token ids of about `length` tokens: filler with the key line at fraction `depth` of it (0 = the
    start, 1 = just before the question), then the question."""
    def build(reps: int) -> list[int]:
        before = round(reps * depth)
        return tokenizer.encode(FILLER * before + KEY_LINE.format(key=key) + FILLER * (reps - before) + QUESTION)

    fixed = len(tokenizer.encode(KEY_LINE.format(key=key) + QUESTION))
    reps = max(1, (length - fixed) // max(1, len(tokenizer.encode(FILLER, add_special_tokens=False))))
    per_rep = max(1e-9, (len(build(reps)) - fixed) / reps)  # repeated filler merges across its seams
    return build(max(0, int((length - fixed) / per_rep)))


@dataclass
class PasskeyCell:
    length: int  # the prompt's tokens (as built)
    depth: float
    correct: int
    trials: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials


def passkey(llm, lengths: list[int], depths: list[float], trials: int, seed: int = 0) -> list[PasskeyCell]:
    """Accuracy of greedy retrieval per (length, depth): the key must appear in the first 8 new tokens."""
    from turbollm import SamplingParams

    tok = llm.engine.tokenizer
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=8)
    cells = []
    for length in lengths:
        for depth in depths:
            keys = [rng.randrange(10000, 100000) for _ in range(trials)]
            prompts = [passkey_prompt(tok, length, depth, k) for k in keys]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            correct = sum(str(k) in o.outputs[0].text for k, o in zip(keys, outs))
            cells.append(PasskeyCell(len(prompts[0]), depth, correct, trials))
    return cells


def plot_by_position(curves: dict[str, list[tuple[int, int, float]]], path: str, title: str) -> bool:
    """Perplexity against position, one curve per setting; False when matplotlib is missing."""
    from turbollm.benchmarks.report import pyplot

    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, buckets in curves.items():
        ax.plot([(a + b) / 2 for a, b, _ in buckets], [p for _, _, p in buckets], marker="o", ms=3, label=name)
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("perplexity (bucket)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
