"""`turbollm proxy --prefill URL ... --decode URL ...`: one OpenAI API in front of prefill and decode instances
(turbollm/server/proxy.py)."""

from __future__ import annotations

import argparse
import time

from turbollm.errors import TurboLLMError


def add_proxy(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="serve the OpenAI API over prefill and decode instances (prefill/decode "
                                     "disaggregation)")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                   help="prefill instances: `turbollm serve MODEL --kv-transfer-config "
                        "'{\"kv_connector\": \"p2p\", \"kv_role\": \"kv_producer\"}'`")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances (kv_role kv_consumer), on the same host as the prefill instances (their "
                        "K/V pass through shared memory)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="seconds a prefill instance may take before the request is prefilled on a decode instance")
    p.add_argument("--startup-timeout", type=float, default=10.0,
                   help="seconds to wait at start for every instance to answer /health")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_proxy)


def wait_for_instances(flags: dict[str, list[str]], timeout: float) -> None:
    """Every URL answers GET /health within `timeout` seconds, or an error names the flag and the URL."""
    import httpx

    deadline = time.monotonic() + timeout
    for flag, urls in flags.items():
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise TurboLLMError(f"{flag} {url!r}: not an http:// or https:// URL")
            while True:
                try:
                    if httpx.get(url.rstrip("/") + "/health", timeout=2).status_code == 200:
                        break
                    why = "its /health is not 200"
                except httpx.HTTPError as e:
                    why = f"{type(e).__name__}"
                if time.monotonic() > deadline:
                    raise TurboLLMError(f"{flag} {url}: no answer within {timeout:.0f} s ({why})")
                time.sleep(0.25)


def run_proxy(ns: argparse.Namespace) -> int:
    import uvicorn

    from turbollm.server.proxy import build_proxy_app

    wait_for_instances({"--prefill": ns.prefill, "--decode": ns.decode}, ns.startup_timeout)
    app = build_proxy_app(ns.prefill, ns.decode, ns.prefill_timeout)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level)
    return 0
