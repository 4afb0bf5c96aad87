"""What every endpoint shares: model names, admission, prompt checks, SamplingParams, engine streams.

`ServingContext` owns the AsyncLLMEngine handle, the served model names, the bounded
admission count (`--max-waiting-requests`, counted in engine sequences: a request of p prompts
with n samples each takes p x n) and the metrics. `generate()` is one engine request as an
async iterator of RequestOutputs that records metrics and always closes its stream (closing an
unfinished stream aborts the request and returns its KV blocks).

CPU-bound work a request brings (tokenizing a body of up to `--max-request-bytes`, rendering a
chat template, detokenizing) runs in a worker thread (`off_loop`), never on the event loop that
feeds every open stream.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from turbollm.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError, RequestFailedError
from turbollm.outputs import RequestOutput
from turbollm.sampling_params import SamplingParams
from turbollm.server.errors import APIError, bad_request
from turbollm.server.metrics import RequestTimer, ServerMetrics

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """Run `fn(*args, **kw)` in a worker thread, so the event loop keeps serving the open streams."""
    return await asyncio.to_thread(fn, *args, **kw)


_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class ServingContext:
    def __init__(self, aengine: AsyncLLMEngine, served_names: list[str], metrics: ServerMetrics,
                 max_waiting_requests: int | None = None):
        self.aengine = aengine
        self.engine = aengine.engine
        self.tokenizer = aengine.engine.tokenizer
        self.max_model_len = aengine.engine.max_model_len
        self.vocab_size = aengine.engine.config.vocab_size
        self.served_names = served_names
        self.metrics = metrics
        self.in_flight = 0  # engine sequences (prompts x n) admitted and not yet done (event-loop thread only)
        max_seqs = aengine.engine.args.max_num_seqs
        self.capacity = None if max_waiting_requests is None else max_seqs + max_waiting_requests

    # ------------------------------------------------------------------ admission
    def check_model(self, name: str | None) -> str:
        if name not in self.served_names:
            raise APIError(404, f"the model {name!r} does not exist; served: {', '.join(self.served_names)}",
                           "model", "model_not_found")
        return name

    def admit(self, k: int) -> "Slot":
        """Take k sequence slots (prompts x n) or raise 503 (queue full; 400 when k could never fit);
        release them with `Slot.release()`."""
        if not self.aengine.is_running:
            raise APIError(503, "the engine is shutting down", code="engine_unavailable")
        if self.capacity is not None and k > self.capacity:
            raise bad_request(f"the request needs {k} sequences (prompts x n) but the server admits at most "
                              f"{self.capacity} at once", "n")
        if self.capacity is not None and self.in_flight + k > self.capacity:
            self.metrics.rejected.labels(self.metrics.model_name).inc()
            raise APIError(503, f"the server is at capacity ({self.in_flight} sequences in flight, "
                                f"limit {self.capacity}); retry later", code="queue_full",
                           headers={"Retry-After": "1"})
        self.in_flight += k
        return Slot(self, k)

    # ------------------------------------------------------------------ prompts and params
    def check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request("the prompt is empty (0 tokens)", param)
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise bad_request(f"token id {t} is outside the vocabulary [0, {self.vocab_size})", param)
        return ids

    def check_length(self, n_prompt: int, max_tokens: int | None, param: str) -> None:
        m = self.max_model_len
        if n_prompt >= m:
            raise bad_request(f"this model's maximum context length is {m} tokens, but the prompt has "
                              f"{n_prompt} tokens (at least one token must be left for the completion)",
                              param, "context_length_exceeded")
        if max_tokens is not None and n_prompt + max_tokens > m:
            raise bad_request(f"this model's maximum context length is {m} tokens, but {n_prompt + max_tokens} "
                              f"were requested ({n_prompt} in the prompt, {max_tokens} for the completion); "
                              "lower max_tokens or the prompt", "max_tokens", "context_length_exceeded")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (in a worker thread)."""
        return await off_loop(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def render_chat(self, messages: list, add_generation_prompt: bool = True) -> list[int]:
        """The chat template applied to `messages`, as checked token ids (in a worker thread)."""
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
        ids = await off_loop(self.tokenizer.apply_chat_template, msgs, add_generation_prompt=add_generation_prompt,
                             tokenize=True)
        return self.check_ids(ids, "messages")

    def tokenizer_info(self) -> dict[str, Any]:
        """What vLLM's /tokenizer_info gives: the special tokens' texts, the chat template, the context."""
        tok = self.tokenizer
        return {"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                "add_bos_token": tok.add_bos_token, "add_eos_token": tok.add_eos_token,
                "chat_template": tok.chat_template, "model_max_length": self.max_model_len,
                "vocab_size": tok.vocab_size}

    def sampling_params(self, req: Any, max_tokens: int | None, logprobs: int | None, **extra: Any) -> SamplingParams:
        """The request's SamplingParams (`extra`: more SamplingParams fields, e.g. prompt_logprobs), its token
        ids checked against the vocabulary here, before a stream starts."""
        kw: dict[str, Any] = dict(n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
                                  stop_token_ids=req.stop_token_ids, seed=req.seed, ignore_eos=req.ignore_eos,
                                  include_stop_str_in_output=req.include_stop_str_in_output,
                                  skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
                                  logit_bias=req.logit_bias, kv_transfer_params=req.kv_transfer_params)
        for name in _OPTIONAL:
            v = getattr(req, name)
            if v is not None:
                kw[name] = v
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({req.min_tokens}) is larger than max_tokens ({max_tokens})", "min_tokens")
        params = SamplingParams(**kw, **extra)
        params.check_token_ids(self.vocab_size)
        return params

    # ------------------------------------------------------------------ engine
    async def generate(self, ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        timer = RequestTimer(self.metrics, time.monotonic())
        stream = self.aengine.generate({"prompt_token_ids": ids}, params, request_id)
        ended = "abort"  # how a request that never finished is counted: the client left, or an error
        try:
            async for out in stream:
                now = time.monotonic()
                timer.on_output(out, now)
                if out.finished:
                    timer.on_finish(out, now)
                    ended = ""
                yield out
        except EngineDeadError as e:
            ended = "error"
            raise APIError(503, f"the engine is not available: {e}", code="engine_unavailable") from e
        except RequestFailedError as e:  # this request alone failed inside the engine
            ended = "error"
            raise APIError(500, str(e), code="request_failed") from e
        except EngineStepError as e:
            ended = "error"
            raise APIError(500, f"the engine step failed: {e.__cause__ or e}", code="engine_error") from e
        finally:
            if ended:
                timer.on_unfinished(params.n, ended)
            await stream.aclose()

    async def final_output(self, ids: list[int], params: SamplingParams, request_id: str) -> RequestOutput:
        last = None
        async for out in self.generate(ids, params, request_id):
            last = out
        assert last is not None and last.finished
        return last


class Slot:
    """Admitted request slots, given back once: by `release()`, or when dropped (a stream never started)."""

    __slots__ = ("ctx", "k")

    def __init__(self, ctx: ServingContext, k: int):
        self.ctx, self.k = ctx, k

    def release(self) -> None:
        if self.k:
            self.ctx.in_flight -= self.k
            self.k = 0

    __del__ = release


async def run_until_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (so its engine requests abort) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise APIError(499, "the client disconnected")
    return task.result()


async def gather_all(coros: list[Awaitable[Any]]) -> list[Any]:
    """asyncio.gather that cancels the rest when one fails or when it is cancelled itself."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; with `cached_tokens` (prompt tokens served from the prefix cache) its
    `prompt_tokens_details` too."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def sse(obj: Any) -> str:
    import json

    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as (stream index, output); closing this closes them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
