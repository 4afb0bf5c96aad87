"""OpenAI error bodies: `{"error": {"message", "type", "param", "code"}}`, and the handlers that make them.

A client's mistake is always a 4xx with a message naming the field (`param`) where there is
one: pydantic validation errors and InvalidRequestError are 400, an unknown model 404, a body
over the limit 413, a full queue 503 with Retry-After. Anything else is a 500 whose body says
it was the server's fault.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from turbollm.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error with its HTTP status and OpenAI body fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every 4xx/5xx answer."""

    error: ErrorDetail


_DESCRIPTIONS = {400: "Invalid request (the field is named in error.param)", 401: "Missing or wrong API key",
                 404: "Unknown model", 413: "Request body over --max-request-bytes",
                 500: "Server error", 503: "Server at capacity (Retry-After) or engine not running"}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` for a route: the error statuses it answers, each with the error body schema."""
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS[s]} for s in statuses}


def use_error_schemas(app: FastAPI) -> None:
    """Make the OpenAPI schema say what the server answers: a validation error is a 400 with the OpenAI
    error body (the handler below), never FastAPI's 422, so 422 is taken out of every route."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    if isinstance(op, dict) and "422" in op.get("responses", {}):
                        bad = op["responses"].pop("422")
                        op["responses"].setdefault("400", {**bad, "description": _DESCRIPTIONS[400],
                                                           "content": {"application/json": {"schema": {
                                                               "$ref": "#/components/schemas/ErrorResponse"}}}})
            schemas = schema.get("components", {}).get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def stream_error_body(e: Exception) -> dict[str, Any]:
    """The error event of an SSE stream whose 200 status line has already been sent."""
    if isinstance(e, APIError):
        return error_body(e.message, e.type, e.param, e.code)
    return error_body(f"{type(e).__name__}: {e}", "server_error")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status,
                        headers=err.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def _loc_to_param(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; union-member tags are dropped."""
    parts = [p for p in loc if p != "body"]
    if not parts or not isinstance(parts[0], str):
        return None
    out = parts[0]
    for p in parts[1:]:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p.isidentifier() and p not in ("str", "int", "float", "bool", "list", "dict") and "[" not in p:
            out += f".{p}"
    return out


def _validation_message(e: dict) -> str:
    param = _loc_to_param(tuple(e.get("loc", ())))
    msg = e.get("msg", "invalid value")
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', msg)}"
    if e.get("type") == "missing":
        return f"'{param}' is a required field"
    if param is None:
        return f"invalid request body: {msg}"
    value = e.get("input")
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"invalid value for '{param}': {msg} (got {shown})"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # A union (prompt, stop, content) fails once per member: report the first error only.
        first = errors[0] if errors else {"msg": "invalid request"}
        param = _loc_to_param(tuple(first.get("loc", ())))
        return error_response(APIError(400, _validation_message(first), param, "invalid_value"))

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        msg = str(exc)
        param = None
        if msg.startswith("SamplingParams."):  # "SamplingParams.top_p: must be ..."
            param = msg.split(":", 1)[0].split(".", 1)[1]
        return error_response(APIError(400, msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = exc.detail if isinstance(exc.detail, str) and exc.detail else f"HTTP {exc.status_code}"
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        return error_response(APIError(exc.status_code, msg, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}: {exc}"))
