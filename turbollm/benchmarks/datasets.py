"""Benchmark requests: token-id prompts with a fixed output length, the same for every backend.

Prompts are tokenized once, here, with turbollm's tokenizer (its ids equal transformers'), and
both backends receive the same ids: tokenization is outside every timed region.

- ShareGPT: the first N records of `sharegpt/ShareGPT_V3_filtered_500.json` in file order
  (deterministic), `conversations[0]["value"]`, truncated to `max_input_len` tokens.
- random: N prompts of exactly `input_len` token ids drawn uniformly from the vocabulary with a
  fixed seed, special tokens excluded (so no prompt holds a BOS/EOS/chat marker).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from turbollm.errors import BenchmarkError

SHAREGPT_FILE = Path("sharegpt") / "ShareGPT_V3_filtered_500.json"


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def default_data_dir() -> Path:
    """`shared/data` beside the repository (…/main/../shared/data)."""
    return (Path(__file__).resolve().parents[2] / ".." / "shared" / "data").resolve()


def sharegpt_path(data_dir: str | Path | None = None) -> Path:
    """The ShareGPT file under `data_dir` (default: `default_data_dir()`); a BenchmarkError if missing."""
    path = (Path(data_dir).expanduser() if data_dir else default_data_dir()) / SHAREGPT_FILE
    if not path.is_file():
        raise BenchmarkError(f"ShareGPT prompts not found at {path}; pass --data-dir DIR (the folder holding "
                             f"{SHAREGPT_FILE}) or use --dataset random")
    return path


def load_sharegpt_texts(data_dir: str | Path | None, count: int) -> list[str]:
    """The first `count` ShareGPT prompt texts, in file order."""
    path = sharegpt_path(data_dir)
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    return [r["conversations"][0]["value"] for r in records[:count]]


def sharegpt_requests(tokenizer, num_prompts: int, output_len: int, max_input_len: int,
                      data_dir: str | Path | None = None) -> list[BenchRequest]:
    """The first `num_prompts` ShareGPT prompts in file order, each cut to `max_input_len` tokens."""
    texts = load_sharegpt_texts(data_dir, num_prompts)
    if num_prompts > len(texts):
        raise BenchmarkError(f"--num-prompts {num_prompts}: {SHAREGPT_FILE} holds only {len(texts)} prompts")
    out = []
    for ids in tokenizer.encode_batch(texts):
        ids = ids[:max_input_len]
        if not ids:
            raise BenchmarkError("a ShareGPT prompt encodes to 0 tokens")
        out.append(BenchRequest(ids, output_len))
    return out


def random_prompt_ids(tokenizer, length: int, generator: torch.Generator) -> list[int]:
    """`length` token ids drawn uniformly from the vocabulary, special tokens excluded."""
    vocab = tokenizer.vocab_size
    special = set(tokenizer.special_token_ids) | set(tokenizer.eos_token_ids)
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            special.add(tid)
    allowed = torch.tensor(sorted(set(range(vocab)) - special), dtype=torch.int64)
    picks = torch.randint(0, allowed.numel(), (length,), generator=generator)
    return allowed[picks].tolist()


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """`num_prompts` different random prompts of exactly `input_len` tokens (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return [BenchRequest(random_prompt_ids(tokenizer, input_len, gen), output_len) for _ in range(num_prompts)]


def fit_to_context(requests: list[BenchRequest], max_model_len: int) -> tuple[list[BenchRequest], int]:
    """Cut prompts so prompt + output fits the context (every request must yield all its tokens).

    Returns the requests and how many were cut.
    """
    out, cut = [], 0
    for r in requests:
        room = max_model_len - r.output_len
        if room < 1:
            raise BenchmarkError(f"--output-len {r.output_len} leaves no room for a prompt in a context of "
                                 f"{max_model_len} tokens")
        if r.prompt_len > room:
            out.append(BenchRequest(r.prompt_token_ids[:room], r.output_len))
            cut += 1
        else:
            out.append(r)
    return out, cut


def length_summary(requests: list[BenchRequest]) -> dict:
    lens = [r.prompt_len for r in requests]
    return {"num_requests": len(requests), "prompt_tokens": sum(lens), "prompt_len_min": min(lens),
            "prompt_len_mean": round(sum(lens) / len(lens), 1), "prompt_len_max": max(lens),
            "output_len": requests[0].output_len, "output_tokens": sum(r.output_len for r in requests)}
