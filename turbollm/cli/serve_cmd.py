"""`turbollm serve MODEL`: an OpenAI-compatible HTTP server (see turbollm/server)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from turbollm.cli.engine_flags import add_engine_flags, engine_args_from

logger = logging.getLogger("turbollm.serve")


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_name", nargs="?", default=None, metavar="MODEL",
                   help="catalog name, GGUF file or HF folder (or --model)")
    add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=[],
                   help="extra names requests may use for the model (the MODEL as given always works)")
    p.add_argument("--api-key", default=os.environ.get("TURBOLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TURBOLLM_API_KEY)")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests allowed to wait beyond --max-num-seqs; more get 503 (default: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="request body limit (413 above)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    p.add_argument("--no-webui", dest="webui", action="store_false",
                   help="do not serve the chat page at / and the dashboard at /dashboard")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--disaggregate", default=None, metavar="P:D",
                   help="prefill/decode disaggregation on this host: P prefill and D decode instances, each its own "
                        "process pinned to its own cores, their K/V handed over through shared memory, and "
                        "`turbollm proxy` on --host/--port in front of them")
    p.set_defaults(func=run_serve)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's graceful shutdown, plus: requests still running after `grace` seconds are aborted."""

        def __init__(self, config, aengine, grace: float):
            super().__init__(config)
            self.aengine, self.grace = aengine, grace

        async def shutdown(self, sockets=None) -> None:
            async def abort_later() -> None:
                await asyncio.sleep(self.grace)
                if self.aengine.num_in_flight:
                    logger.warning("aborting %d request(s) still running after %.0f s",
                                   self.aengine.num_in_flight, self.grace)
                await self.aengine.shutdown(drain=False, timeout=5)

            task = asyncio.ensure_future(abort_later())
            try:
                await super().shutdown(sockets)
            finally:
                task.cancel()

    return Server


def run_serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from turbollm.engine.llm_engine import LLMEngine
    from turbollm.entrypoints.async_engine import AsyncLLMEngine
    from turbollm.gc_heap import freeze_startup_heap
    from turbollm.server.app import ServerSettings, build_app

    _Server = _server_class()

    if ns.model_name:
        ns.model = ns.model_name
    if ns.disaggregate:
        from turbollm.cli.disaggregate import run_disaggregated

        return run_disaggregated(ns, getattr(ns, "argv", None) or sys.argv[1:])
    if ns.max_waiting_requests is not None and ns.max_waiting_requests < 0:
        raise SystemExit("turbollm serve: --max-waiting-requests must be >= 0")
    names = list(dict.fromkeys(ns.served_model_name + [ns.model]))  # the first one labels the metrics
    aengine = AsyncLLMEngine(LLMEngine.from_engine_args(engine_args_from(ns)))
    settings = ServerSettings(served_model_names=names, api_key=ns.api_key,
                              max_waiting_requests=ns.max_waiting_requests,
                              max_request_bytes=ns.max_request_bytes, shutdown_timeout=ns.shutdown_timeout,
                              webui=ns.webui)
    app = build_app(aengine, settings)
    freeze_startup_heap()  # full GC passes while serving skip the engine's start-up objects
    # uvicorn's own timeout is a backstop: at --shutdown-timeout the engine aborts what is
    # left, so every open stream ends with finish_reason "abort" and [DONE].
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                            timeout_graceful_shutdown=int(ns.shutdown_timeout) + 5, access_log=False)
    server = _Server(config, aengine, ns.shutdown_timeout)
    # uvicorn re-raises the signal it stopped on once it is done; a handler of our own makes
    # SIGTERM a clean exit (code 0) after the graceful shutdown.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        if aengine.is_running:
            aengine.shutdown_sync(drain=False, timeout=ns.shutdown_timeout)
    return 0 if server.started else 1
