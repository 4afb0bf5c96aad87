"""The prefill/decode proxy: one OpenAI API in front of prefill instances and decode instances.

Each completion or chat request goes first to a prefill instance (`kv_role` kv_producer), as the same request
with `max_tokens` 1, no stream and `kv_transfer_params: {"do_remote_decode": true}`: it prefills, samples the
first token and leaves the prompt's K/V for a decode instance (a p2p KV connector). Its answer's
`kv_transfer_params` (where the K/V wait, the first token and its logprobs) then ride with the original request
to the least loaded decode instance (kv_consumer), whose answer — streamed or not, logprobs, stop strings,
usage — is relayed as it comes. The first token is the prefill instance's, never sampled again.

Faults: a prefill instance that cannot be reached, errs (5xx) or times out is marked down for a while and the
request goes to a decode instance as it came, to be prefilled there (logged, counted:
`turbollm_proxy:prefill_fallbacks`); a request with n > 1 always is (each sample draws its own first token). A
decode instance that cannot be reached is marked down and the next one tried; one that dies mid-stream ends that
stream with an error event, never a hang. A prefill instance's 4xx (a bad request) is the client's answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from turbollm.server.errors import error_body

logger = logging.getLogger("turbollm.proxy")
DOWN_SECONDS = 5.0  # an instance that failed is skipped this long (then tried again)


@dataclass
class Instance:
    url: str
    in_flight: int = 0
    down_until: float = 0.0

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until


@dataclass
class Pool:
    """The instances of one role; `pick` gives the least loaded one that is up (all of them when none is)."""

    role: str
    instances: list[Instance]

    def pick(self, skip: set[str] = frozenset()) -> Instance | None:
        live = [i for i in self.instances if i.url not in skip and i.up] or \
            [i for i in self.instances if i.url not in skip]
        return min(live, key=lambda i: i.in_flight) if live else None

    def down(self, inst: Instance, why: str) -> None:
        inst.down_until = time.monotonic() + DOWN_SECONDS
        logger.warning("%s instance %s marked down for %.0f s: %s", self.role, inst.url, DOWN_SECONDS, why)


@dataclass
class ProxyStats:
    requests: int = 0
    prefilled_remotely: int = 0
    prefill_fallbacks: int = 0  # requests a decode instance prefilled itself (no prefill instance answered)
    decode_failures: int = 0  # requests that ended with an error because no decode instance could finish them
    prefill_seconds: list[float] = field(default_factory=list)

    def metrics_text(self) -> str:
        lines = []
        for name, doc in (("requests", "Requests the proxy took."),
                          ("prefilled_remotely", "Requests prefilled on a prefill instance."),
                          ("prefill_fallbacks", "Requests a decode instance prefilled itself (no prefill instance "
                                                "answered, or n > 1)."),
                          ("decode_failures", "Requests ended with an error: no decode instance finished them.")):
            lines += [f"# HELP turbollm_proxy:{name}_total {doc}", f"# TYPE turbollm_proxy:{name}_total counter",
                      f"turbollm_proxy:{name}_total {getattr(self, name)}"]
        s = sorted(self.prefill_seconds)
        lines += ["# HELP turbollm_proxy:prefill_seconds Time of the prefill instance's answer.",
                  "# TYPE turbollm_proxy:prefill_seconds summary"]
        for q in (0.5, 0.9, 0.99):
            lines.append(f'turbollm_proxy:prefill_seconds{{quantile="{q}"}} {s[int(q * (len(s) - 1))] if s else 0.0}')
        lines += [f"turbollm_proxy:prefill_seconds_count {len(s)}", f"turbollm_proxy:prefill_seconds_sum {sum(s)}"]
        return "\n".join(lines) + "\n"


def instance_kv_series(text: str, role: str, url: str) -> str:
    """An instance's `turbollm:kv_*` series (Prometheus text) as `turbollm_proxy:instance_kv_*`, each sample
    labelled with the instance's URL and role."""
    out = []
    for line in text.splitlines():
        if line.startswith("# ") and " turbollm:kv_" in line:
            kind, rest = line[2:].split(" ", 1)
            if kind in ("HELP", "TYPE"):
                out.append(f"# {kind} " + rest.replace("turbollm:kv_", "turbollm_proxy:instance_kv_", 1))
        elif line.startswith("turbollm:kv_"):
            name, _, value = line.rpartition(" ")
            extra = f'instance="{url}",role="{role}"'
            name = name.replace("turbollm:kv_", "turbollm_proxy:instance_kv_", 1)
            name = name[:-1] + "," + extra + "}" if name.endswith("}") else name + "{" + extra + "}"
            out.append(f"{name} {value}")
    return "\n".join(out) + "\n" if out else ""


def _prefill_body(body: dict, chat: bool) -> dict:
    """The request as a prefill instance takes it: one token, no stream, the hand-off asked for."""
    pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    pre.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    pre["min_tokens"] = min(int(body.get("min_tokens") or 0), 1)
    return pre


def build_proxy_app(prefill: list[str], decode: list[str], prefill_timeout: float = 60.0,
                    request_timeout: float = 600.0) -> FastAPI:
    import httpx

    prefillers = Pool("prefill", [Instance(u.rstrip("/")) for u in prefill])
    decoders = Pool("decode", [Instance(u.rstrip("/")) for u in decode])
    stats = ProxyStats()
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=5.0))
        yield
        await state["client"].aclose()

    app = FastAPI(title="turbollm proxy", lifespan=lifespan)
    app.state.stats, app.state.pools = stats, (prefillers, decoders)

    def _headers(request: Request) -> dict:
        auth = request.headers.get("authorization")
        return {"authorization": auth} if auth else {}

    async def _prefill(path: str, body: dict, headers: dict) -> tuple[dict | None, Response | None]:
        """(the hand-off params, None) from a prefill instance; (None, the client's answer) for a 4xx; (None, None)
        when the decode instance must prefill itself."""
        if body.get("n", 1) != 1 or not prefillers.instances:
            return None, None
        inst = prefillers.pick()
        inst.in_flight += 1
        t0 = time.monotonic()
        try:
            r = await state["client"].post(inst.url + path, json=_prefill_body(body, path.endswith("chat/completions")),
                                           headers=headers, timeout=prefill_timeout)
        except (httpx.HTTPError, OSError) as e:
            prefillers.down(inst, f"{type(e).__name__}: {e}")
            return None, None
        finally:
            inst.in_flight -= 1
        stats.prefill_seconds.append(time.monotonic() - t0)
        if 400 <= r.status_code < 500:
            return None, JSONResponse(r.json(), status_code=r.status_code)
        handoff = r.json().get("kv_transfer_params") if r.status_code == 200 else None
        if handoff is not None:  # (a decode instance on another host fetches the blocks from there)
            handoff = {**handoff, "remote_url": inst.url}
        if handoff is None:
            prefillers.down(inst, f"HTTP {r.status_code}" if r.status_code != 200 else "no kv_transfer_params "
                                  "in its answer (is it started with a p2p kv_producer?)")
        return handoff, None

    async def _route(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(error_body("the request body is not valid JSON", "invalid_request_error"), 400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the request body must be a JSON object", "invalid_request_error"), 400)
        stats.requests += 1
        headers = _headers(request)
        handoff, answer = await _prefill(path, body, headers)
        if answer is not None:
            return answer
        if handoff is None:
            stats.prefill_fallbacks += 1
            logger.info("request prefilled on a decode instance (%s)",
                        "n > 1" if body.get("n", 1) != 1 else "no prefill instance answered")
        else:
            stats.prefilled_remotely += 1
            body = {**body, "kv_transfer_params": handoff}
        return await _to_decoder(path, body, headers)

    async def _to_decoder(path: str, body: dict, headers: dict) -> Response:
        """The request on the least loaded decode instance, its answer relayed: a stream as it comes, anything
        else whole (an error status as is). An instance that cannot be reached is marked down and the next one
        tried with the same hand-off; one that fails after taking a non-streamed request answers 502."""
        client, tried = state["client"], set()
        while (inst := decoders.pick(tried)) is not None:
            tried.add(inst.url)
            inst.in_flight += 1
            relayed = False  # (a relayed stream gives the instance back when it ends: `_relay`)
            try:
                r = await client.send(client.build_request("POST", inst.url + path, json=body, headers=headers),
                                      stream=True)
                if r.status_code == 200 and body.get("stream"):
                    relayed = True
                    return StreamingResponse(_relay(inst, r), media_type="text/event-stream")
                try:
                    content = await r.aread()
                finally:
                    await r.aclose()
            except (httpx.HTTPError, OSError) as e:
                decoders.down(inst, f"{type(e).__name__}: {e}")
                if isinstance(e, httpx.ConnectError) or body.get("stream"):  # (never took it: the next one may)
                    continue
                stats.decode_failures += 1
                return JSONResponse(error_body(f"decode instance {inst.url} failed: {type(e).__name__}",
                                               "server_error"), 502)
            finally:
                if not relayed:
                    inst.in_flight -= 1
            return Response(content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        stats.decode_failures += 1
        return JSONResponse(error_body("no decode instance answered", "server_error"), 503)

    async def _relay(inst: Instance, r):
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        except (httpx.HTTPError, OSError) as e:  # it died mid-stream: end the stream with an error event
            decoders.down(inst, f"{type(e).__name__}: {e}")
            stats.decode_failures += 1
            yield "data: " + json.dumps(error_body(f"decode instance {inst.url} failed mid-stream: "
                                                   f"{type(e).__name__}", "server_error")) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            inst.in_flight -= 1
            await r.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        inst = decoders.pick()
        try:
            r = await state["client"].get(inst.url + "/v1/models", headers=_headers(request), timeout=10)
        except (httpx.HTTPError, OSError) as e:
            return JSONResponse(error_body(f"decode instance {inst.url}: {type(e).__name__}", "server_error"), 503)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        async def ok(inst: Instance) -> bool:
            try:
                return (await state["client"].get(inst.url + "/health", timeout=2)).status_code == 200
            except (httpx.HTTPError, OSError):
                return False

        checks = await asyncio.gather(*(ok(i) for i in decoders.instances))
        return JSONResponse({"decode": dict(zip((i.url for i in decoders.instances), checks)),
                             "prefill": {i.url: i.up for i in prefillers.instances}},
                            status_code=200 if any(checks) else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """The proxy's counters, then every instance's KV-transfer series (`turbollm:kv_*`: blocks and bytes moved,
        the transfer-time histogram, failures, fallbacks, blocks held), relabelled with the instance and its role."""

        async def scrape(role: str, inst: Instance) -> str:
            try:
                r = await state["client"].get(inst.url + "/metrics", timeout=2)
                return instance_kv_series(r.text, role, inst.url) if r.status_code == 200 else ""
            except (httpx.HTTPError, OSError):
                return ""

        parts = await asyncio.gather(*(scrape(pool.role, i) for pool in (prefillers, decoders) for i in pool.instances))
        return Response(stats.metrics_text() + "".join(parts), media_type="text/plain; version=0.0.4")

    return app
