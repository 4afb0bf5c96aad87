"""POST /v1/chat/completions: messages rendered with the model's chat template → one or n replies."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from turbollm.entrypoints.streaming import DeltaTracker
from turbollm.outputs import PositionLogprobs
from turbollm.server.errors import bad_request, stream_error_body
from turbollm.server.protocol import ChatCompletionRequest
from turbollm.server.serving import ServingContext, Slot, run_until_disconnect, sse, usage


def chat_logprobs(ctx: ServingContext, token_ids: list[int], lps: list[PositionLogprobs], k: int) -> dict:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(tid: int, lp) -> dict:
        return {"token": lp.decoded_token or "", "logprob": lp.logprob,
                "bytes": list(ctx.tokenizer.token_bytes(tid))}

    content = []
    for tid, pos in zip(token_ids, lps):
        top = sorted(((t, lp) for t, lp in pos.items() if lp.rank is not None and lp.rank <= k),
                     key=lambda kv: kv[1].rank)
        content.append({**entry(tid, pos[tid]), "top_logprobs": [entry(t, lp) for t, lp in top]})
    return {"content": content}


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, request: Request):
    model = ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    ids = await ctx.render_chat(req.messages, req.add_generation_prompt)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    ctx.check_length(len(ids), max_tokens, "messages")
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, max_tokens, k)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    slot = ctx.admit(req.n)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(ctx, slot, ids, params, rid, created, model, req.n, k, include_usage),
                                 media_type="text/event-stream")
    try:
        out = await run_until_disconnect(request.receive, ctx.final_output(ids, params, rid))
    finally:
        slot.release()
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(ctx, c.token_ids, c.logprobs, k) if k is not None and c.logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
               for c in sorted(out.outputs, key=lambda c: c.index)]
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(len(ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)}
    if out.kv_transfer_params is not None:  # a prefill instance's hand-off (vLLM's field)
        body["kv_transfer_params"] = out.kv_transfer_params
    return JSONResponse(body)


async def _stream(ctx: ServingContext, slot: Slot, ids: list[int], params, rid: str, created: int, model: str,
                  n: int, k: int | None, include_usage: bool) -> AsyncIterator[str]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    stream = ctx.generate(ids, params, rid)
    tracker = DeltaTracker(params.stop_strings)
    n_out = cached = 0
    try:
        for i in range(n):
            yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        async for out in stream:
            for d in tracker.update(out):
                lp = chat_logprobs(ctx, d.token_ids, d.logprobs, k) if k is not None and d.logprobs else None
                delta = {"content": d.text} if d.text or not d.finished else {}
                yield sse({**head, "choices": [{"index": d.index, "delta": delta, "logprobs": lp,
                                                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]})
            if out.finished:
                n_out, cached = sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(len(ids), n_out, cached)})
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
        yield sse(stream_error_body(e))
    finally:
        await stream.aclose()
        slot.release()
    yield "data: [DONE]\n\n"
