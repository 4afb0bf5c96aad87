"""Request bodies of the OpenAI API (the fields turbollm serves), as pydantic models.

Unknown fields are ignored (OpenAI clients send fields we do not know about); the known ones
are validated, so a wrong type or an out-of-range value is a 400 naming the field.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

MAX_LOGPROBS = 20  # completions `logprobs` and chat `top_logprobs`
MAX_N = 16


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extras included)."""

    model: str
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    seed: StrictInt | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: StrictInt = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # prefill/decode disaggregation (vLLM's field; a p2p KV connector): {"do_remote_decode": true} asks a prefill
    # instance to leave the prompt's K/V for a decode instance; a decode instance takes the params it returned
    kv_transfer_params: dict | None = None


Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: StrictInt | None = Field(16, ge=0)  # 0 only with echo (checked by the endpoint)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[StrictInt]
