"""GET /kv_transfer/{engine_id}/{name}: a prefill instance's hand-off as a bundle, for a decode instance on another host.

On one host a decode instance copies the blocks straight from the prefill instance's pool in shared memory; on
another host it cannot open that pool (nor find the hand-off file), and its worker fetches the bundle from the
prefill instance's server instead (the `remote_url` the proxy adds to the hand-off; worker/kv_p2p.py). The server
claims the hand-off as a local consumer would, gathers the blocks from the pool into a bundle
(kv_transfer/pool_handoff.py `bundle_of`) and releases it, so the prefill instance frees the blocks. Only names
the engine wrote are served (its engine id, 32 hex digits + `.kvs`); anything else is 404, as is a hand-off not
written yet (the consumer asks again until its deadline). Outside /v1, like /metrics: no API key (bind the
server to an address only the instances reach).
"""

from __future__ import annotations

import re

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from turbollm.kv_transfer.pool_handoff import KVFrameError, PoolError, bundle_of
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
            data = await off_loop(bundle_of, str(path))
        except (KVFrameError, PoolError, OSError) as e:
            # (not 404: the consumer stops asking and prefills itself)
            return JSONResponse(error_body(f"hand-off {name} cannot be sent: {e}", "invalid_request_error"), 422)
        if data is None:
            return JSONResponse(error_body(f"no hand-off {name} (not written yet, taken, or expired)", "not_found"),
                                404)
        return Response(data, media_type="application/octet-stream")
