"""GET /kv_transfer/{engine_id}/{name}: a prefill instance's hand-off bundle, for a decode instance on another host.

On one host a decode instance reads the bundle straight from shared memory; on another host the path it was
given does not exist there, and its worker fetches the bundle from the prefill instance's server instead (the
`remote_url` the proxy adds to the hand-off; worker/kv_connector.py). The bundle is deleted once sent, as a
consumer deletes the one it read. Only names the engine wrote are served (its engine id, 32 hex digits +
`.kvs`); anything else is 404, as is a bundle not written yet (the consumer asks again until its deadline).
Outside /v1, like /metrics: no API key (bind the server to an address only the instances reach).
"""

from __future__ import annotations

import os
import re

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from turbollm.server.errors import error_body
from turbollm.server.serving import off_loop

_NAME = re.compile(r"[0-9a-f]{32}\.kvs")


def add_bundle_route(app: FastAPI, engine) -> None:
    """`engine`: the LLMEngine whose KV connector wrote the bundles."""

    @app.get("/kv_transfer/{engine_id}/{name}", include_in_schema=False)
    async def bundle(engine_id: str, name: str) -> Response:
        conn = getattr(engine.kv_manager, "connector", None)
        folder = getattr(conn, "folder", None)
        if folder is None or engine_id != getattr(conn, "engine_id", None) or not _NAME.fullmatch(name):
            return Response(status_code=404)
        path = folder / name
        try:
            data = await off_loop(path.read_bytes)
        except FileNotFoundError:
            return JSONResponse(error_body(f"no bundle {name} (not written yet, taken, or swept)", "not_found"), 404)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return Response(data, media_type="application/octet-stream")
