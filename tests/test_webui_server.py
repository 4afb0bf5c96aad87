"""The chat page's server side, without a browser, on a tiny random llama in process (fast tier).

What `/` and `/static/*` serve (every file the page names is served; a Content-Security-Policy that lets
the page load nothing from elsewhere; ETags), `--no-webui`, `/props` (settings' defaults from
SamplingParams), `/stats` (the dashboard's JSON: counters that move after a request, samples after
`since`, latency percentiles), and the chat usage's `prompt_tokens_details.cached_tokens` (the prefix
cache's hit on a repeated prompt). The page itself is driven in a browser by test_webui_browser.py.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from quant_tiny import add_chat_template, build_tiny
from test_server_clients import NAME, serve_in_loop
from turbollm.server.dashboard import LatencyWindow
from turbollm.server.webui import STATIC, WebUI

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return add_chat_template(build_tiny("llama", tmp_path_factory.mktemp("tiny-llama-webui")))


def test_every_file_the_page_names_is_shipped():
    ui = WebUI()
    html = ui.files["index.html"].body.decode()
    named = set(re.findall(r'(?:src|href)="/static/([^"]+)"', html))
    for name, f in ui.files.items():
        if name.endswith(".js"):
            named |= set(re.findall(r'from "\./([^"]+)"', f.body.decode()))
    assert named and named <= set(ui.files), named - set(ui.files)
    assert ui.total_bytes == sum(p.stat().st_size for p in STATIC.iterdir())
    for f in ui.files.values():  # nothing from elsewhere: no absolute URL the browser would load
        assert not re.search(rb'(src|href)="(https?:)?//', f.body)


def test_page_props_stats_and_cached_tokens(tiny):
    body = {"model": NAME, "messages": [{"role": "user", "content": "w5 w16 w27 w38 w49 w60 w71 w82 " * 4}],
            "max_tokens": 6, "temperature": 0}

    async def scenario(client):
        page = await client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
        again = await client.get("/", headers={"If-None-Match": page.headers["etag"]})
        assert again.status_code == 304
        assert (await client.get("/dashboard")).text == page.text
        js = await client.get("/static/chat.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert (await client.get("/static/nope.js")).status_code == 404
        assert (await client.get("/static/..%2Fapp.py")).status_code == 404

        props = (await client.get("/props")).json()
        assert props["model"] == NAME and props["api_key_required"] is False
        assert props["defaults"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "max_tokens": None}
        assert props["webui_bytes"] == WebUI().total_bytes

        before = (await client.get("/stats")).json()
        t0 = before["samples"][-1]["t"]
        first = (await client.post("/v1/chat/completions", json=body)).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        second = (await client.post("/v1/chat/completions", json=body)).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < second["usage"]["prompt_tokens"] and cached % 16 == 0  # whole blocks of 16
        stream = await client.post("/v1/chat/completions", json={**body, "stream": True,
                                                                  "stream_options": {"include_usage": True}})
        usage = [line for line in stream.text.splitlines() if '"usage"' in line][-1]
        assert f'"cached_tokens": {cached}' in usage

        await asyncio.sleep(1.05)  # a new sample is due
        after = (await client.get("/stats", params={"since": t0})).json()
        tot = after["totals"]
        n_out = sum(r["usage"]["completion_tokens"] for r in (first, second)) + 6
        assert tot["generation_tokens"] - before["totals"]["generation_tokens"] == n_out
        assert tot["requests_finished"] - before["totals"]["requests_finished"] == 3
        assert tot["steps"] > before["totals"]["steps"] and tot["prefix_cache_hits"] == 2 * cached
        assert tot["kv_groups"][0]["kind"] == "full_attention" and tot["kv_groups"][0]["blocks_total"] > 0
        assert all(s["t"] > t0 for s in after["samples"]) and after["samples"]
        last = after["samples"][-1]
        assert {"batch_size", "tokens_per_step", "generation_tps", "prefix_hit_rate"} <= set(last)
        assert after["latency"]["ttft"]["count"] == before["latency"]["ttft"]["count"] + 3
        assert after["latency"]["itl"]["count"] > 0 and after["latency"]["ttft"]["p99_ms"] > 0

    serve_in_loop(tiny, scenario)


def test_no_webui(tiny):
    async def scenario(client):
        assert (await client.get("/")).status_code == 404
        assert (await client.get("/static/app.js")).status_code == 404
        props = (await client.get("/props")).json()  # no key needed: it holds no secret
        assert props["api_key_required"] is True and props["webui_bytes"] == 0
        assert (await client.post("/v1/chat/completions", json={})).status_code == 401

    serve_in_loop(tiny, scenario, settings={"webui": False, "api_key": "k"}, max_num_seqs=2)


def test_latency_window_percentiles_and_expiry():
    w = LatencyWindow(window=10.0)
    for i in range(1, 101):
        w.add(100.0, i / 1000)
    s = w.summary(105.0)
    assert s["count"] == 100 and s["p50_ms"] == pytest.approx(50) and s["p99_ms"] == pytest.approx(99)
    assert s["mean_ms"] == pytest.approx(50.5)
    w.add(112.0, 0.5, count=2)
    s = w.summary(112.0)  # the first 100 are older than the window
    assert s["count"] == 2 and s["p50_ms"] == pytest.approx(500)
    assert LatencyWindow().summary(0.0)["p90_ms"] is None


def test_dashboard_with_speculation_and_quantized_kv(tiny):
    """The dashboard's speculative-decoding figures and a quantized KV format's bytes by dtype (int8 blocks, float16
    rings of recent tokens), read from an engine stepped here."""
    from turbollm.engine_args import EngineArgs
    from turbollm.engine.llm_engine import LLMEngine
    from turbollm.sampling_params import SamplingParams
    from turbollm.server.dashboard import Dashboard
    from turbollm.server.metrics import ServerMetrics

    eng = LLMEngine(EngineArgs(model=str(tiny), threads=1, max_num_seqs=2, kv_cache_dtype="int8",
                               # (not adaptive: its step-cost measurement could decide, on a busy machine, that
                               # drafting does not pay — this test is about the dashboard's figures)
                               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                   "adaptive": False}))
    d = Dashboard(eng, ServerMetrics(eng, NAME))
    d.sample(now=1000.0)
    prompt = [1] + [5, 17, 29, 41] * 8  # a repeated pattern for the n-gram proposer to find
    eng.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    held = {}
    while eng.has_unfinished_requests():
        eng.step()
        held = eng.stats()["kv_groups"] if eng.stats()["kv_blocks_used"] else held
    s = d.sample(now=1002.0)
    raw = eng.stats()
    assert raw["spec_decode_num_drafts"] > 0
    assert s["spec_acceptance_rate"] == raw["spec_decode_num_accepted_tokens"] / raw["spec_decode_num_draft_tokens"]
    assert s["spec_mean_accepted_length"] == 1 + raw["spec_decode_num_accepted_tokens"] / raw["spec_decode_num_drafts"]
    assert s["steps"] == raw["num_steps"] and s["steps_per_s"] == raw["num_steps"] / 2
    assert s["tokens_per_step"] == raw["num_step_tokens"] / raw["num_steps"] and s["batch_size"] == 1.0
    snap = d.snapshot()
    assert snap["totals"]["speculative"] is True and snap["totals"]["spec_mean_accepted_length"] >= 1
    assert [g["kind"] for g in held] == ["full_attention", "recent"]
    assert held[0]["dtype"] == "int8" and held[0]["bytes_used"] > 0 and held[1]["dtype"] == "float16"
    assert set(snap["totals"]["kv_bytes_by_dtype"]) == {"int8", "float16 (recent-token rings)"}
