"""POST /v1/completions: prompts (text, token ids, or lists of either) → completions, streamed or not.

`echo` puts each prompt in front of its completion; with `logprobs` the prompt's tokens come
first in the logprobs too (the first has no logprob: nothing precedes it), so a client can score
a text by sending it as the prompt with `max_tokens` 0 (or 1, as lm-evaluation-harness does) —
vLLM's behaviour. `prompt_logprobs` (a vLLM extension) returns each prompt position's logprob
and top k as `choices[i].prompt_logprobs`. `max_tokens: 0` is accepted with `echo` only; the
engine then samples one token that is not returned.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from turbollm.entrypoints.streaming import DeltaTracker
from turbollm.outputs import PositionLogprobs, RequestOutput
from turbollm.server.errors import bad_request, stream_error_body
from turbollm.server.protocol import CompletionRequest
from turbollm.server.serving import (ServingContext, Slot, gather_all, merge_streams, off_loop,
                                     run_until_disconnect, sse, usage)


@dataclass
class _Prompt:
    """One prompt of the request: its token ids and its text (what `echo` returns)."""

    ids: list[int]
    text: str


async def prompt_list(ctx: ServingContext, prompt: Any, echo: bool) -> list[_Prompt]:
    """The request's prompts, each checked (non-empty, in the vocabulary); tokenized off the event loop."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif not prompt:
        raise bad_request("the prompt is empty", "prompt")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    out = []
    for p in items:
        if isinstance(p, str):
            out.append(_Prompt(ctx.check_ids(await ctx.encode(p), "prompt"), p))
        else:
            ids = ctx.check_ids(list(p), "prompt")
            out.append(_Prompt(ids, await off_loop(ctx.tokenizer.decode, ids) if echo else ""))
    return out


def completion_logprobs(token_ids: list[int], lps: list[PositionLogprobs | None], k: int, offset: int = 0) -> dict:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset. A position without
    logprobs (the first prompt token under `echo`) has None for its logprob and its top."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, pos in zip(token_ids, lps):
        chosen = pos.get(tid) if pos is not None else None
        piece = chosen.decoded_token or "" if chosen is not None else ""
        tokens.append(piece)
        token_lps.append(chosen.logprob if chosen is not None else None)
        if pos is None:
            tops.append(None)
        else:
            ranked = sorted(pos.items(), key=lambda kv: (kv[1].rank or 0))
            tops.append({lp.decoded_token or "": lp.logprob for t, lp in ranked
                         if t == tid or (lp.rank is not None and lp.rank <= k)})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _merge_logprobs(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


def prompt_logprobs_json(lps: list[PositionLogprobs | None] | None) -> list | None:
    """`prompt_logprobs` as vLLM serves it: per position None or {token id: {logprob, rank, decoded_token}}."""
    if lps is None:
        return None
    return [None if pos is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                               "decoded_token": lp.decoded_token} for t, lp in pos.items()}
            for pos in lps]


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request):
    model = ctx.check_model(req.model)
    if req.suffix is not None:
        raise bad_request("'suffix' is not supported", "suffix")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be >= 1 (0 only with 'echo', to score the prompt)", "max_tokens")
    prompts = await prompt_list(ctx, req.prompt, bool(req.echo))
    for p in prompts:
        ctx.check_length(len(p.ids), req.max_tokens, "prompt")
    score_only = req.max_tokens == 0  # run one token for the prompt's logprobs, return none
    # echo with logprobs needs the prompt's logprobs; prompt_logprobs asks for them on its own
    want_prompt_lps = max([k for k in ((req.logprobs if req.echo else None), req.prompt_logprobs) if k is not None],
                          default=None)
    if score_only and req.min_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) is larger than max_tokens (0)", "min_tokens")
    params = ctx.sampling_params(req, 1 if score_only else req.max_tokens, req.logprobs,
                                 prompt_logprobs=want_prompt_lps)
    rid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), req.n
    shape = _Shape(bool(req.echo), score_only, req.logprobs, req.prompt_logprobs is not None)
    slot = ctx.admit(len(prompts) * n)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(ctx, slot, prompts, params, rid, created, model, n, shape, include_usage)
        return StreamingResponse(body, media_type="text/event-stream")
    try:
        outs = await run_until_disconnect(request.receive, gather_all(
            [ctx.final_output(p.ids, params, f"{rid}-{i}") for i, p in enumerate(prompts)]))
    finally:
        slot.release()
    choices = []
    for i, (p, out) in enumerate(zip(prompts, outs)):
        for c in out.outputs:
            token_ids = [] if score_only else c.token_ids
            lps = c.logprobs if not score_only else []
            choice = {"index": i * n + c.index, "text": (p.text if req.echo else "") + ("" if score_only else c.text),
                      "logprobs": shape.logprobs(p, out, token_ids, lps, 0),
                      "finish_reason": c.finish_reason, "stop_reason": None if score_only else c.stop_reason}
            if shape.prompt_lps:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
            choices.append(choice)
    choices.sort(key=lambda ch: ch["index"])
    n_out = 0 if score_only else sum(len(c.token_ids) for o in outs for c in o.outputs)
    body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(sum(len(p.ids) for p in prompts), n_out)}
    if len(outs) == 1 and outs[0].kv_transfer_params is not None:  # a prefill instance's hand-off (vLLM's field)
        body["kv_transfer_params"] = outs[0].kv_transfer_params
    return JSONResponse(body)


@dataclass
class _Shape:
    """What each choice carries: the echoed prompt, no completion (max_tokens 0), logprobs, prompt_logprobs."""

    echo: bool
    score_only: bool
    k: int | None
    prompt_lps: bool

    def logprobs(self, p: _Prompt, out: RequestOutput, token_ids: list[int], lps: list[PositionLogprobs] | None,
                 offset: int, with_prompt: bool = True) -> dict | None:
        """The choice's logprobs: the prompt's first under echo (when `with_prompt`), then `token_ids`'."""
        if self.k is None:
            return None
        if not (self.echo and with_prompt):
            return completion_logprobs(token_ids, lps or [], self.k, offset)
        prompt = completion_logprobs(p.ids, out.prompt_logprobs or [None] * len(p.ids), self.k, offset)
        gen = completion_logprobs(token_ids, lps or [], self.k, offset + sum(len(t) for t in prompt["tokens"]))
        return _merge_logprobs(prompt, gen)


async def _stream(ctx: ServingContext, slot: Slot, prompts: list[_Prompt], params, rid: str, created: int,
                  model: str, n: int, shape: _Shape, include_usage: bool) -> AsyncIterator[str]:
    streams = [ctx.generate(p.ids, params, f"{rid}-{i}") for i, p in enumerate(prompts)]
    merged = merge_streams(streams)
    trackers = [DeltaTracker(params.stop_strings) for _ in prompts]
    offsets: dict[int, int] = {}
    started: set[int] = set()  # choices whose first chunk (with the echoed prompt) has been sent
    n_out = 0
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    try:
        async for i, out in merged:
            for d in trackers[i].update(out):
                index = i * n + d.index
                first = index not in started
                started.add(index)
                if shape.score_only:
                    d.text, d.token_ids, d.logprobs, d.stop_reason = "", [], [], None
                lp = shape.logprobs(prompts[i], out, d.token_ids, d.logprobs, offsets.get(index, 0), first)
                if lp is not None:
                    offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp["tokens"])
                choice = {"index": index, "text": (prompts[i].text if shape.echo and first else "") + d.text,
                          "logprobs": lp, "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
                if shape.prompt_lps and first:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                yield sse({**head, "choices": [choice]})
            if out.finished and not shape.score_only:
                n_out += sum(len(c.token_ids) for c in out.outputs)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(sum(len(p.ids) for p in prompts), n_out)})
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
        yield sse(stream_error_body(e))
    finally:
        await merged.aclose()
        for s in streams:
            await s.aclose()
        slot.release()
    yield "data: [DONE]\n\n"
