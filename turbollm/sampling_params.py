"""`SamplingParams`: how to pick tokens for one request, validated at construction (vLLM names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from turbollm.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
# `seed` is a 64-bit signed integer (as vLLM bounds it); sibling i of an n > 1 request draws
# with seed + i, which torch's generator still takes.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # added to the logits before sampling, per token id (OpenAI's logit_bias: values in [-100, 100])
    logit_bias: dict[int, float] | None = None
    # prefill/decode disaggregation (a p2p KV connector, handoff/kv_transfer.py; vLLM's field): {"do_remote_decode":
    # true} on a prefill instance; on a decode instance, the prefill's returned params and its "first_token"
    kv_transfer_params: dict | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{name}: {why}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad(name, f"must be a number, got {v!r}")
            if not math.isfinite(v):
                raise bad(name, f"must be a finite number, got {v!r}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)):
            raise bad("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise bad(name, f"must be a non-negative integer, got {v!r}")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise bad("stop", f"must be a string or a list of strings, got {type(self.stop).__name__}")
        self._stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            raise bad("stop", "stop entries must be non-empty strings")
        if self.stop_token_ids is not None and (not isinstance(self.stop_token_ids, (list, tuple)) or
                                                not all(isinstance(t, int) for t in self.stop_token_ids)):
            raise bad("stop_token_ids", "must be a list of integer token ids")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"token ids must be >= 0, got {min(self.stop_token_ids)}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", f"must be a mapping of token id to bias, got {type(self.logit_bias).__name__}")
            bias = {}
            for k, v in self.logit_bias.items():
                try:  # JSON object keys are strings ("1234")
                    t = int(k)
                except (TypeError, ValueError):
                    raise bad("logit_bias", f"keys must be token ids, got {k!r}") from None
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                    raise bad("logit_bias", f"values must be numbers in [-100, 100], got {v!r} for token {k}")
                if t < 0:
                    raise bad("logit_bias", f"token ids must be >= 0, got {t}")
                bias[t] = float(v)
            self.logit_bias = bias or None
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise bad("kv_transfer_params", f"must be a mapping, got {type(self.kv_transfer_params).__name__}")

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise InvalidRequestError if a token id the request names is outside [0, vocab_size)."""
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab_size:
                raise InvalidRequestError(f"SamplingParams.stop_token_ids: token id {t} is outside the "
                                          f"vocabulary [0, {vocab_size})")
        for t in self.logit_bias or {}:
            if not 0 <= t < vocab_size:
                raise InvalidRequestError(f"SamplingParams.logit_bias: token id {t} is outside the "
                                          f"vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_history(self) -> bool:
        """Whether sampling a token depends on the tokens before it (penalties, min_tokens), not only on
        its logits: speculative verification then gives each row its own history, drafts included."""
        return (self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)
                or self.min_tokens > 0)

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list
