"""`turbollm serve`: one real server process for the module, driven by the official openai client and httpx.

The server runs smollm2-135m on one thread with a 256 MiB KV cache, an API key (from
TURBOLLM_API_KEY), `--max-waiting-requests 0` (so the 33rd concurrent request is refused) and
a 1 MB body limit. The last test stops it with SIGTERM and checks the exit code.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from conftest import catalog_model_path, free_port, serve_process  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.slow]

KEY = "test-key"
NAME = "smol"
MAX_SEQS = 32
BODY_LIMIT = 1_000_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(catalog_model_path("smollm2-135m"))
    port = free_port()
    proc = serve_process(
        [path, "--threads", "1", "--kv-cache-memory", "0.25", "--max-num-seqs", str(MAX_SEQS), "--served-model-name",
         NAME, "--max-waiting-requests", "0", "--max-request-bytes", str(BODY_LIMIT), "--shutdown-timeout", "3",
         "--log-level", "warning"],
        port, tmp_path_factory.mktemp("server") / "server.log", env=dict(os.environ, TURBOLLM_API_KEY=KEY))
    yield {"base": f"http://127.0.0.1:{port}", "proc": proc, "model": path}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server["base"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def metrics(http) -> dict[str, float]:
    """Sum of every sample of each metric name (labels summed over)."""
    out: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        m = re.match(r"^(turbollm:[a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def wait_idle(http, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if m["turbollm:num_requests_running"] == 0 and m["turbollm:kv_cache_usage_perc"] == 0:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"the engine did not go idle: {m}")
        time.sleep(0.1)


# ------------------------------------------------------------------------------ basics
def test_models_health_version(server, http, client):
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    ids = [m.id for m in client.models.list().data]
    assert ids == [NAME, server["model"]]


def test_api_key_required(server):
    r = httpx.post(server["base"] + "/v1/completions", json={"model": NAME, "prompt": "x"})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server["base"] + "/health").status_code == 200  # only /v1 is guarded


def test_completion_usage_matches_tokenizer(http, client):
    prompt = "The capital of France is"
    count = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.usage.prompt_tokens == count
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == count + 8
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    ids = http.post("/tokenize", json={"prompt": prompt + r.choices[0].text}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith(r.choices[0].text)


def test_chat_usage_matches_tokenizer(http, client):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "color."}]}]
    tok = http.post("/tokenize", json={"messages": msgs}).json()
    r = client.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=6, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.prompt_tokens == tok["count"] and tok["max_model_len"] > tok["count"]
    assert 1 <= r.usage.completion_tokens <= 6


def test_token_id_prompts_and_batches(client):
    r = client.completions.create(model=NAME, prompt=[[504, 3575, 282], [1, 2, 3, 4]], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 6


def _stream_text(chunks, chat: bool) -> tuple[dict[int, str], dict[int, str], dict | None]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                assert c.index not in finish, "finish_reason sent twice"
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def test_streaming_equals_non_streaming(client):
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=24, temperature=0.8, seed=1)
    full = client.completions.create(**kw)
    texts, finish, usage = _stream_text(client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}), chat=False)
    assert texts[0] == full.choices[0].text and finish[0] == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens

    msgs = [{"role": "user", "content": "Tell me a story."}]
    ckw = dict(model=NAME, messages=msgs, max_tokens=24, temperature=0.8, seed=1)
    cfull = client.chat.completions.create(**ckw)
    ctexts, cfinish, cusage = _stream_text(client.chat.completions.create(
        **ckw, stream=True, stream_options={"include_usage": True}), chat=True)
    assert ctexts[0] == cfull.choices[0].message.content and cfinish[0] == cfull.choices[0].finish_reason
    assert cusage.completion_tokens == cfull.usage.completion_tokens


def test_n2(client):
    r = client.completions.create(model=NAME, prompt="My favourite fruit is", max_tokens=6, n=2, temperature=1.0,
                                  seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 12
    texts, finish, _ = _stream_text(client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, stream=True), chat=True)
    assert sorted(finish) == [0, 1] and all(texts.values())


def test_logprobs(client):
    r = client.completions.create(model=NAME, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and len(top) >= 3 and max(top.values()) == pytest.approx(val)  # greedy: chosen is top
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Count to 3"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)
    assert "".join(e.token for e in content) == c.choices[0].message.content


def test_stop_strings(client):
    kw = dict(model=NAME, prompt="1, 2, 3, 4, 5,", max_tokens=16, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    assert " 8," in text, text
    r = client.completions.create(**kw, stop=[" 8,", "zzz"])
    assert r.choices[0].text == text[:text.index(" 8,")] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("stop_reason") == " 8,"
    texts, finish, _ = _stream_text(client.completions.create(**kw, stop=" 8,", stream=True), chat=False)
    assert texts[0] == r.choices[0].text and finish[0] == "stop"


# ------------------------------------------------------------------------------ load and faults
def test_concurrent_streams_and_metrics(server, http):
    before = wait_idle(http)
    n_clients, max_tokens = MAX_SEQS, 8

    async def one(ac, i):
        stream = await ac.completions.create(model=NAME, prompt=f"Item {i}:", max_tokens=max_tokens,
                                             temperature=0.7, seed=i, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
        usage, finish = None, None
        async for ch in stream:
            usage = ch.usage or usage
            for c in ch.choices:
                finish = c.finish_reason or finish
        return usage, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0,
                                      timeout=120) as ac:
            return await asyncio.gather(*[one(ac, i) for i in range(n_clients)])

    results = asyncio.run(main())
    assert all(u.completion_tokens == max_tokens and f == "length" for u, f in results)
    after = wait_idle(http)
    assert after["turbollm:kv_cache_usage_perc"] == 0 and after["turbollm:kv_cache_bytes_used"] == 0
    assert 0 < after["turbollm:kv_cache_bytes_peak"] <= after["turbollm:kv_cache_bytes_total"]
    gen = after["turbollm:generation_tokens_total"] - before["turbollm:generation_tokens_total"]
    assert gen == n_clients * max_tokens
    assert after["turbollm:request_success_total"] - before["turbollm:request_success_total"] == n_clients
    assert after["turbollm:prompt_tokens_total"] - before["turbollm:prompt_tokens_total"] == sum(
        u.prompt_tokens for u, _ in results)
    assert after["turbollm:time_to_first_token_seconds_count"] >= n_clients


def test_disconnect_aborts(server, http):
    before = wait_idle(http)
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data:")
            if n == 2:
                break
        assert metrics(http)["turbollm:num_requests_running"] == 1
    m = wait_idle(http, timeout=5)
    # the one request made in between was aborted by the disconnect: counted once, under finished_reason
    # "abort" (as vLLM counts it); .get: no samples exist before the first finish
    success = "turbollm:request_success_total"
    assert m.get(success, 0.0) - before.get(success, 0.0) == 1
    assert 'finished_reason="abort"' in http.get("/metrics").text


def test_disconnect_aborts_non_streaming(server, http):
    """A client that gives up on a non-streamed request (timeout) aborts it too."""
    wait_idle(http)
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=1.5)
    wait_idle(http, timeout=5)


def test_queue_full_503(server, http):
    """`--max-waiting-requests 0`: at most max_num_seqs requests in flight, the next one gets 503 + Retry-After."""
    wait_idle(http)
    body = {"model": NAME, "prompt": "Tell me", "max_tokens": 2000, "ignore_eos": True, "stream": True}

    async def main():
        async with httpx.AsyncClient(base_url=server["base"], headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=60) as ac:
            streams = []
            try:
                for _ in range(MAX_SEQS):
                    cm = ac.stream("POST", "/v1/completions", json=body)
                    r = await cm.__aenter__()
                    streams.append(cm)
                    assert r.status_code == 200
                extra = await ac.post("/v1/completions", json={**body, "stream": False, "max_tokens": 1})
                return extra
            finally:
                for cm in streams:
                    await cm.__aexit__(None, None, None)

    extra = asyncio.run(main())
    assert extra.status_code == 503 and extra.headers["retry-after"]
    assert extra.json()["error"]["code"] == "queue_full"
    wait_idle(http, timeout=10)
    assert http.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 1}).status_code == 200


C, CH = "/v1/completions", "/v1/chat/completions"
GOOD = {"model": NAME, "prompt": "Hello", "max_tokens": 2}
GOODC = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BAD = [
    # (name, path, body (dict or raw str), status, param)
    ("bad json", C, '{"model": "smol", "prompt": ', 400, None),
    ("body is a list", C, "[1, 2]", 400, None),
    ("missing prompt", C, {"model": NAME}, 400, "prompt"),
    ("missing model", C, {"prompt": "x"}, 400, "model"),
    ("temperature -1", C, {**GOOD, "temperature": -1}, 400, "temperature"),
    ("temperature str", C, {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("top_p 2", C, {**GOOD, "top_p": 2}, 400, "top_p"),
    ("top_k -5", C, {**GOOD, "top_k": -5}, 400, "top_k"),
    ("n 0", C, {**GOOD, "n": 0}, 400, "n"),
    ("n 1000", C, {**GOOD, "n": 1000}, 400, "n"),
    ("max_tokens 0", C, {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens x", C, {**GOOD, "max_tokens": "x"}, 400, "max_tokens"),
    ("min_tokens > max_tokens", C, {**GOOD, "min_tokens": 5}, 400, "min_tokens"),
    ("presence_penalty 3", C, {**GOOD, "presence_penalty": 3}, 400, "presence_penalty"),
    ("seed str", C, {**GOOD, "seed": "abc"}, 400, "seed"),
    ("unknown model", C, {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("model path", C, {**GOOD, "model": "/etc/passwd"}, 404, "model"),
    ("prompt over max_model_len", C, {**GOOD, "prompt": [1] * 9000}, 400, "prompt"),
    ("prompt + max_tokens over", C, {**GOOD, "prompt": [1] * 8190, "max_tokens": 16}, 400, "max_tokens"),
    ("empty prompt", C, {**GOOD, "prompt": ""}, 400, "prompt"),
    ("empty prompt list", C, {**GOOD, "prompt": []}, 400, "prompt"),
    ("mixed prompt list", C, {**GOOD, "prompt": [1, "a"]}, 400, "prompt"),
    ("token id out of vocab", C, {**GOOD, "prompt": [1, 99999999]}, 400, "prompt"),
    ("negative token id", C, {**GOOD, "prompt": [-1]}, 400, "prompt"),
    ("prompt_logprobs 50", C, {**GOOD, "prompt_logprobs": 50}, 400, "prompt_logprobs"),
    ("seed 2**70", C, {**GOOD, "seed": 2 ** 70}, 400, "seed"),
    ("stop_token_ids out of vocab", C, {**GOOD, "stop_token_ids": [99999999], "min_tokens": 1}, 400, "stop_token_ids"),
    ("stop_token_ids negative", C, {**GOOD, "stop_token_ids": [-3]}, 400, "stop_token_ids"),
    ("suffix", C, {**GOOD, "suffix": "end"}, 400, "suffix"),
    ("logprobs 50", C, {**GOOD, "logprobs": 50}, 400, "logprobs"),
    ("stop int", C, {**GOOD, "stop": 5}, 400, "stop"),
    ("stop empty string", C, {**GOOD, "stop": [""]}, 400, "stop"),
    ("huge body", C, {**GOOD, "prompt": "x" * (BODY_LIMIT + 10)}, 413, None),
    ("chat empty messages", CH, {**GOODC, "messages": []}, 400, "messages"),
    ("chat missing messages", CH, {"model": NAME}, 400, "messages"),
    ("chat bad role", CH, {**GOODC, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("chat content int", CH, {**GOODC, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat image part", CH, {**GOODC, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("chat top_logprobs 30", CH, {**GOODC, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ("chat top_logprobs without logprobs", CH, {**GOODC, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat unknown model", CH, {**GOODC, "model": "nope"}, 404, "model"),
    ("tokenize nothing", "/tokenize", {}, 400, "prompt"),
    ("detokenize out of vocab", "/detokenize", {"tokens": [99999999]}, 400, "tokens"),
    ("no such route", "/v1/embeddings", GOOD, 404, None),
]


def test_malformed_requests(http, client):
    failures = []
    for name, path, body, status, param in BAD:
        if isinstance(body, str):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
        try:
            err = r.json()["error"]
            ok = (r.status_code == status and isinstance(err["message"], str) and err["message"]
                  and isinstance(err["type"], str) and (param is None or err["param"] == param))
        except (ValueError, KeyError, TypeError):
            ok, err = False, r.text[:200]
        if not ok:
            failures.append(f"{name}: {r.status_code} {err}")
    assert not failures, "\n".join(failures)
    assert len(BAD) >= 20
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=2)  # the server still serves
    assert r.usage.completion_tokens >= 1
    wait_idle(http)


def test_bench_serve(server, http, tmp_path):
    """`turbollm bench serve` against the module server: every request completes with exact token counts."""
    from turbollm.cli.main import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", server["base"], "--api-key", KEY, "--dataset", "random",
               "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--request-rate", "inf", "20",
               "--max-concurrency", "2", "--slo-ttft-ms", "60000", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["setting"]["model"] == NAME and len(res["results"]) == 2
    for s in res["results"]:
        assert s["completed"] == 4 and s["failed"] == 0 and s["output_tokens"] == 16 and s["prompt_tokens"] == 32
        assert s["goodput"] == pytest.approx(s["request_throughput"])
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] and s["tpot_ms"]["p50"] > 0
    # a trace replayed at two speeds: one run each, at its offered rate, and the plot against the rate
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,30,3\n"
                     "2023-11-16 18:15:47.6805900,12,2\n2023-11-16 18:15:48.6805900,9,3\n")
    rc = main(["bench", "serve", "--base-url", server["base"], "--api-key", KEY, "--dataset", "azure", "--trace",
               str(trace), "--num-prompts", "3", "--max-input-len", "16", "--trace-speedup", "4", "8",
               "--json", str(out), "--plot", str(tmp_path / "rates.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [s["trace_speedup"] for s in res["results"]] == [4, 8]
    assert [s["request_rate"] for s in res["results"]] == pytest.approx([4.0, 8.0])  # 3 requests over 2 s / speedup
    assert all(s["completed"] == 3 and s["output_tokens"] == 8 and s["prompt_tokens"] == 37 for s in res["results"])
    assert (tmp_path / "rates.png").stat().st_size > 10_000
    wait_idle(http)


def test_zz_sigterm_exits_cleanly(server, http):
    """Last: SIGTERM → no new connections, the stream in flight ends ("abort" after --shutdown-timeout 3 s,
    then [DONE]), the engine stops, exit code 0."""
    import threading

    proc = server["proc"]
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 5000, "ignore_eos": True, "stream": True}
        try:
            with http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        started.set()
        except httpx.HTTPError as e:
            lines.append(repr(e))
        started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the server did not exit within 20 s of SIGTERM")
    t.join(10)
    assert rc == 0, proc.log_text()
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][5:])["choices"][0]["finish_reason"] == "abort"
