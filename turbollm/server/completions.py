"""POST /v1/completions: prompts (text, token ids, or lists of either) → completions, streamed or not."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from turbollm.entrypoints.streaming import DeltaTracker
from turbollm.outputs import PositionLogprobs
from turbollm.server.errors import bad_request, stream_error_body
from turbollm.server.protocol import CompletionRequest
from turbollm.server.serving import (ServingContext, Slot, gather_all, merge_streams, run_until_disconnect,
                                     sse, usage)


def prompt_ids(ctx: ServingContext, prompt: Any) -> list[list[int]]:
    """The request's prompts as token ids, each checked (non-empty, in the vocabulary)."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif not prompt:
        raise bad_request("the prompt is empty", "prompt")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    return [ctx.check_ids(ctx.tokenizer.encode(p) if isinstance(p, str) else list(p), "prompt") for p in items]


def completion_logprobs(token_ids: list[int], lps: list[PositionLogprobs], k: int, offset: int = 0) -> dict:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, pos in zip(token_ids, lps):
        chosen = pos[tid]
        piece = chosen.decoded_token or ""
        tokens.append(piece)
        token_lps.append(chosen.logprob)
        ranked = sorted(pos.items(), key=lambda kv: (kv[1].rank or 0))
        tops.append({lp.decoded_token or "": lp.logprob for t, lp in ranked
                     if t == tid or (lp.rank is not None and lp.rank <= k)})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request):
    model = ctx.check_model(req.model)
    if req.echo:
        raise bad_request("'echo' is not supported", "echo")
    if req.suffix is not None:
        raise bad_request("'suffix' is not supported", "suffix")
    prompts = prompt_ids(ctx, req.prompt)
    for ids in prompts:
        ctx.check_length(len(ids), req.max_tokens, "prompt")
    params = ctx.sampling_params(req, req.max_tokens, req.logprobs)
    rid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), req.n
    slot = ctx.admit(len(prompts))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(ctx, slot, prompts, params, rid, created, model, n, req.logprobs, include_usage)
        return StreamingResponse(body, media_type="text/event-stream")
    try:
        outs = await run_until_disconnect(request.receive, gather_all(
            [ctx.final_output(ids, params, f"{rid}-{i}") for i, ids in enumerate(prompts)]))
    finally:
        slot.release()
    choices = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            choices.append({
                "index": i * n + c.index, "text": c.text,
                "logprobs": (completion_logprobs(c.token_ids, c.logprobs, req.logprobs)
                             if req.logprobs is not None and c.logprobs is not None else None),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    choices.sort(key=lambda ch: ch["index"])
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, "usage": usage(sum(map(len, prompts)), n_out)})


async def _stream(ctx: ServingContext, slot: Slot, prompts: list[list[int]], params, rid: str, created: int,
                  model: str, n: int, logprobs: int | None, include_usage: bool) -> AsyncIterator[str]:
    streams = [ctx.generate(ids, params, f"{rid}-{i}") for i, ids in enumerate(prompts)]
    merged = merge_streams(streams)
    trackers = [DeltaTracker(params.stop_strings) for _ in prompts]
    offsets: dict[int, int] = {}
    n_out = 0
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    try:
        async for i, out in merged:
            for d in trackers[i].update(out):
                index = i * n + d.index
                lp = None
                if logprobs is not None and d.logprobs is not None:
                    lp = completion_logprobs(d.token_ids, d.logprobs, logprobs, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp["tokens"])
                yield sse({**head, "choices": [{"index": index, "text": d.text, "logprobs": lp,
                                                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]})
            if out.finished:
                n_out += sum(len(c.token_ids) for c in out.outputs)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(sum(map(len, prompts)), n_out)})
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
        yield sse(stream_error_body(e))
    finally:
        await merged.aclose()
        for s in streams:
            await s.aclose()
        slot.release()
    yield "data: [DONE]\n\n"
