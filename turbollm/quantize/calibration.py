"""Calibration data for GPTQ / AWQ: text → token windows.

Default corpus: the 500 ShareGPT prompts of ``../shared/data/sharegpt`` (first human turn of
each conversation), joined by blank lines and tokenized once without special tokens. Never
the evaluation text: a file named ``wiki.test.raw`` is refused. ``--calib-data PATH`` takes a
ShareGPT-style JSON list or a plain ``.txt`` / ``.jsonl`` file of text instead.

Windows: ``samples`` windows of ``seq_len`` tokens each, their starts spread evenly over the
token stream (deterministic, every region of the corpus represented). When the corpus holds
fewer than ``samples × seq_len`` tokens, windows overlap (as GPTQ's random crops may); the
corpus is too small — an error before any work — when it holds fewer than ``seq_len`` tokens
or when each token would fall in more than `MAX_REUSE` windows on average. The ShareGPT
file holds about 44k tokens for a 49k-vocabulary BPE, so the default 128 × 512 = 65,536
positions reuse each token about 1.5 times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from turbollm.errors import InvalidRequestError

SHAREGPT_FILE = Path("sharegpt") / "ShareGPT_V3_filtered_500.json"
EVALUATION_FILES = ("wiki.test.raw",)  # never calibrate on the evaluation text
MAX_REUSE = 2.0  # windows may cover each corpus token at most this many times on average


def default_calibration_path() -> Path:
    """The ShareGPT prompts beside the repository (…/main/../shared/data/sharegpt/...)."""
    from turbollm.benchmarks.datasets import default_data_dir

    return default_data_dir() / SHAREGPT_FILE


def load_calibration_texts(path: str | Path | None = None) -> list[str]:
    """The calibration documents: ShareGPT JSON (first turn of each record), JSONL or plain text."""
    path = Path(path).expanduser() if path else default_calibration_path()
    if path.name in EVALUATION_FILES:
        raise InvalidRequestError(f"--calib-data {path}: that is the perplexity evaluation text; calibrating on "
                                  f"it would make the evaluation meaningless")
    if not path.is_file():
        raise InvalidRequestError(f"calibration data not found at {path}; pass --calib-data FILE "
                                  f"(ShareGPT-style .json, .jsonl or .txt)")
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            records = json.loads(raw)
            return [r["conversations"][0]["value"] for r in records]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise InvalidRequestError(f"{path}: not a ShareGPT-style JSON list ({e})") from None
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(raw.splitlines()):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(f"{path}:{i + 1}: not JSON ({e})") from None
                texts.append((rec.get("text") or rec.get("prompt") or "") if isinstance(rec, dict) else str(rec))
        return [t for t in texts if t]
    return [t for t in raw.split("\n\n") if t.strip()]


@dataclass(frozen=True)
class CalibrationSet:
    """Token windows ``[samples, seq_len]`` and what they were cut from."""

    windows: torch.Tensor  # int64 [samples, seq_len]
    corpus_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.windows.numel()

    @property
    def reuse(self) -> float:
        """Average number of windows each corpus token falls in."""
        return self.num_tokens / max(1, self.corpus_tokens)


def tokenize_corpus(tokenizer, texts: list[str]) -> torch.Tensor:
    return torch.tensor(tokenizer.encode("\n\n".join(texts), add_special_tokens=False), dtype=torch.int64)


def check_corpus_size(corpus_tokens: int, samples: int, seq_len: int, where: str = "calibration set") -> None:
    """Raise InvalidRequestError when `corpus_tokens` cannot give `samples` windows of `seq_len`."""
    if samples < 1 or seq_len < 2:
        raise InvalidRequestError(f"--calib-samples must be >= 1 and --calib-seq-len >= 2, got {samples} and {seq_len}")
    need = samples * seq_len
    if corpus_tokens < seq_len or need > MAX_REUSE * corpus_tokens:
        raise InvalidRequestError(
            f"{where} too small: {corpus_tokens:,} tokens cannot give {samples} windows of {seq_len} tokens "
            f"({need:,} positions; at most {MAX_REUSE:g}× reuse, i.e. {int(MAX_REUSE * corpus_tokens):,}); lower "
            f"--calib-samples / --calib-seq-len or pass a larger --calib-data")


def make_windows(tokens: torch.Tensor, samples: int, seq_len: int) -> CalibrationSet:
    """`samples` windows of `seq_len` tokens with evenly spread starts over `tokens`."""
    check_corpus_size(tokens.numel(), samples, seq_len)
    last = tokens.numel() - seq_len
    starts = [round(i * last / (samples - 1)) if samples > 1 else 0 for i in range(samples)]
    windows = torch.stack([tokens[s:s + seq_len] for s in starts])
    return CalibrationSet(windows, tokens.numel())


def build_calibration(tokenizer, samples: int, seq_len: int, path: str | Path | None = None) -> CalibrationSet:
    """Load, tokenize and cut the calibration corpus (errors before any model work)."""
    return make_windows(tokenize_corpus(tokenizer, load_calibration_texts(path)), samples, seq_len)
