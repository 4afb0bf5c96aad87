"""build_app(engine, args): the FastAPI app of `turbollm serve`.

`engine` is an AsyncLLMEngine (running); `args` any object with the server settings as
attributes (see `ServerSettings`; the `turbollm serve` namespace works). The app never reads
or writes files on a request's behalf: the model is fixed at start and a request's `model`
must be one of the served names.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from turbollm.entrypoints.async_engine import AsyncLLMEngine
from turbollm.sampling_params import SamplingParams
from turbollm.server.chat import create_chat_completion
from turbollm.server.completions import create_completion
from turbollm.server.dashboard import Dashboard
from turbollm.server.kv_bundles import add_bundle_route
from turbollm.server.errors import (APIError, bad_request, error_body, error_responses, install_error_handlers,
                                    use_error_schemas)
from turbollm.server.metrics import CONTENT_TYPE, ServerMetrics
from turbollm.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest)
from turbollm.server.serving import ServingContext, off_loop
from turbollm.server.webui import WebUI

logger = logging.getLogger("turbollm.serve")


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=lambda: ["smollm2-135m"])
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_request_bytes: int = 4 << 20
    shutdown_timeout: float = 10.0
    webui: bool = True  # the chat page at / and the dashboard at /dashboard


class _Guard:
    """ASGI middleware: request bodies over the limit → 413; `/v1/*` needs the API key when one is set."""

    def __init__(self, app: Any, max_bytes: int, api_key: str | None):
        self.app, self.max_bytes, self.api_key = app, max_bytes, api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and scope["path"].startswith("/v1"):
            auth = headers.get("authorization", "")
            token = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return await _send_error(send, 401, "invalid or missing API key (Authorization: Bearer KEY)",
                                         "authentication_error", "invalid_api_key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(send, 413, f"the request body has {length} bytes; the limit is "
                                     f"{self.max_bytes}", "invalid_request_error", "request_too_large")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            # Read the body here (bounded), then replay it; later receives go to the client.
            chunks, size, more = [], 0, True
            while more:
                msg = await receive()
                if msg["type"] != "http.request":
                    return
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes:
                    return await _send_error(send, 413, f"the request body is over the limit of {self.max_bytes} "
                                             "bytes", "invalid_request_error", "request_too_large")
                chunks.append(chunk)
                more = msg.get("more_body", False)
            body, replayed = b"".join(chunks), False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


async def _send_error(send: Any, status: int, message: str, type: str, code: str) -> None:
    body = json.dumps(error_body(message, type, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def build_app(engine: AsyncLLMEngine, args: Any = None) -> FastAPI:
    from turbollm import __version__

    s = args or ServerSettings()
    names = list(getattr(s, "served_model_names", None) or ["default"])
    shutdown_timeout = float(getattr(s, "shutdown_timeout", 10.0))
    metrics = ServerMetrics(engine.engine, names[0])
    ctx = ServingContext(engine, names, metrics, getattr(s, "max_waiting_requests", None))
    dashboard = Dashboard(engine.engine, metrics)
    api_key = getattr(s, "api_key", None) or None
    webui = WebUI() if getattr(s, "webui", True) else None
    if webui is not None:
        logger.info("chat page at / and dashboard at /dashboard: %d bytes (%d files, nothing from elsewhere)",
                    webui.total_bytes, len(webui.files))
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sampler = asyncio.ensure_future(dashboard.run())
        try:
            yield
        finally:
            sampler.cancel()
            await engine.shutdown(drain=False, timeout=shutdown_timeout)

    app = FastAPI(title="turbollm", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(_Guard, max_bytes=int(getattr(s, "max_request_bytes", 4 << 20)), api_key=api_key)
    if webui is not None:
        webui.mount(app)

    @app.post("/v1/completions", responses=error_responses(400, 401, 404, 413, 503))
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(ctx, req, request)

    @app.post("/v1/chat/completions", responses=error_responses(400, 401, 404, 413, 503))
    async def chat(req: ChatCompletionRequest, request: Request):
        return await create_chat_completion(ctx, req, request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "turbollm", "root": names[0],
             "max_model_len": ctx.max_model_len} for n in names]}

    @app.get("/health", responses=error_responses(503))
    async def health():
        if not engine.is_running:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        return {"status": "ok"}

    add_bundle_route(app, engine.engine)  # a prefill instance's hand-off, for a decode instance on another host

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/stats")
    async def stats(since: float | None = None):
        """The dashboard's JSON (server/dashboard.py): totals, the samples after `since` (unix seconds),
        TTFT/ITL percentiles of the last minutes. Like /metrics, it needs no API key."""
        return dashboard.snapshot(since)

    @app.get("/props")
    async def props():
        """What a client page needs before its first request: the served names, the context length, whether
        /v1 needs an API key, and the sampling settings a chat request gets when it leaves them out."""
        d = SamplingParams()
        return {"model": names[0], "served_model_names": names, "max_model_len": ctx.max_model_len,
                "api_key_required": api_key is not None, "version": __version__,
                "webui_bytes": webui.total_bytes if webui is not None else 0,
                "defaults": {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k, "seed": d.seed,
                             "max_tokens": None}}

    @app.post("/tokenize", responses=error_responses(400, 404, 413))
    async def tokenize(req: TokenizeRequest):
        if req.model is not None:
            ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        if req.prompt is not None:
            ids = await ctx.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            if not req.messages:
                raise bad_request("'messages' is empty", "messages")
            ids = await ctx.render_chat(req.messages, req.add_generation_prompt)
        body = {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}
        # serialized in the worker thread too: FastAPI's encoder walks a long token list in Python on the loop
        return Response(await off_loop(json.dumps, body), media_type="application/json")

    @app.post("/detokenize", responses=error_responses(400, 404, 413))
    async def detokenize(req: DetokenizeRequest):
        if req.model is not None:
            ctx.check_model(req.model)
        for t in req.tokens:
            if not 0 <= t < ctx.vocab_size:
                raise bad_request(f"token id {t} is outside the vocabulary [0, {ctx.vocab_size})", "tokens")
        return {"prompt": await off_loop(ctx.tokenizer.decode, req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """The tokenizer's special tokens and chat template (vLLM's endpoint; lm-evaluation-harness's
        remote tokenizer reads it, then calls /tokenize and /detokenize)."""
        return ctx.tokenizer_info()

    use_error_schemas(app)
    return app
