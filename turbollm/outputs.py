"""What a request returns: vLLM-shaped `RequestOutput`, `CompletionOutput` and `Logprob`."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: {token id: Logprob}, holding the chosen token and the top k.
PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" (RequestOutput.error says why)
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # set when the request failed: its outputs finish with "error"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's field of the same name)
    # a prefill instance's hand-off (a p2p KV connector): where its prompt's K/V wait, and its first token, for the
    # decode instance's request (`SamplingParams.kv_transfer_params`; vLLM's field)
    kv_transfer_params: dict | None = None
