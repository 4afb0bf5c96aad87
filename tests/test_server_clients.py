"""What real clients need from the server, in process on a tiny random llama (tests/quant_tiny.py).

lm-evaluation-harness's log-likelihood requests (`echo` + `logprobs`, `max_tokens` 1 or 0, prompt
token ids) scored against transformers on the same checkpoint; `prompt_logprobs`; `/tokenizer_info`
as its remote tokenizer reads it; `/health`'s body; the OpenAPI schema listing the statuses the
server answers; admission counted in sequences (prompts x n); tokenizing a large body off the
event loop, so open streams keep flowing.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
import torch

from conftest import free_port
from quant_tiny import build_tiny
from turbollm.engine.llm_engine import LLMEngine
from turbollm.engine_args import EngineArgs

httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

NAME = "tiny"
PROMPT = [1] + [5 + (11 * i) % 370 for i in range(12)]  # BOS + 12 words


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("tiny-llama-server"))


@pytest.fixture(scope="module")
def reference_logprobs(tiny):
    """log p(prompt[i] | prompt[:i]) for i >= 1, from transformers on the same checkpoint."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]


def make_app(tiny, settings: dict | None = None, **engine_kw):
    """The app over an engine of `tiny`; `settings`: more ServerSettings fields (webui, api_key, ...)."""
    from turbollm.entrypoints.async_engine import AsyncLLMEngine
    from turbollm.server.app import ServerSettings, build_app

    max_waiting = engine_kw.pop("max_waiting_requests", None)
    engine_kw.setdefault("threads", 1)
    engine_kw.setdefault("max_num_seqs", 8)
    aengine = AsyncLLMEngine(LLMEngine(EngineArgs(model=str(tiny), **engine_kw)))
    app = build_app(aengine, ServerSettings(served_model_names=[NAME], max_waiting_requests=max_waiting,
                                            **(settings or {})))
    return aengine, app


def serve(tiny, scenario, **engine_kw):
    """Run `scenario(client)` against the app served by uvicorn on a free loopback port in a thread of this
    process (real HTTP: streams arrive as they are sent); the server and the engine stop afterwards."""
    import threading

    import uvicorn

    aengine, app = make_app(tiny, **engine_kw)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    async def go():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            for _ in range(200):
                try:
                    await client.get("/version")
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.05)
            return await scenario(client)

    try:
        return asyncio.run(go())
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        aengine.shutdown_sync(timeout=10)


def serve_in_loop(tiny, scenario, **engine_kw):
    """Run `scenario(client)` with the app on the scenario's own event loop (httpx's ASGI transport), so a
    coroutine of the scenario sees every pause of the loop that serves the requests."""
    aengine, app = make_app(tiny, **engine_kw)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            return await scenario(client)

    try:
        return asyncio.run(go())
    finally:
        aengine.shutdown_sync(timeout=10)


def lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-evaluation-harness's parse_logprobs for one choice (its local-completions model): the sum of the
    continuation's token logprobs, and whether each was the top token. The last position is the one
    generated token (its request sends max_tokens 1)."""
    token_lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(token_lps), all(t == max(top.values()) for t, top in zip(token_lps, tops))


def test_echo_logprobs_score_the_prompt_as_lm_eval_reads_them(tiny, reference_logprobs):
    """Before: 'echo' was refused with a 400, so lm-eval's log-likelihood tasks could not run."""
    ctxlen = 5

    async def scenario(client):
        body = {"model": NAME, "prompt": [PROMPT, PROMPT[:8]], "temperature": 0, "max_tokens": 1, "logprobs": 1,
                "seed": 1234, "echo": True}  # the payload lm-eval's local-completions sends
        plain = await client.post("/v1/completions", json={**body, "echo": False, "prompt": PROMPT})
        return await client.post("/v1/completions", json=body), plain

    r, plain = serve(tiny, scenario)
    assert r.status_code == 200, r.text
    full, short = r.json()["choices"]
    from turbollm.tokenizer import load_tokenizer

    assert full["text"] == load_tokenizer(str(tiny)).decode(PROMPT) + plain.json()["choices"][0]["text"]
    lp = full["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) + 1  # the prompt, then the one generated token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes the first token
    assert lp["token_logprobs"][1:len(PROMPT)] == pytest.approx(reference_logprobs, abs=2e-4)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    total, greedy = lm_eval_loglikelihood(full, ctxlen)
    assert total == pytest.approx(sum(reference_logprobs[ctxlen - 1:]), abs=1e-3)
    assert isinstance(greedy, bool)
    assert short["logprobs"]["token_logprobs"][1:8] == pytest.approx(reference_logprobs[:7], abs=2e-4)


def test_echo_text_and_max_tokens_zero(tiny, reference_logprobs):
    async def scenario(client):
        text = "<s> " + " ".join(f"w{t}" for t in PROMPT[1:])  # the tiny tokenizer adds no BOS of its own
        base = {"model": NAME, "prompt": text, "temperature": 0, "echo": True}
        zero = await client.post("/v1/completions", json={**base, "max_tokens": 0, "logprobs": 0})
        two = await client.post("/v1/completions", json={**base, "max_tokens": 2, "ignore_eos": True})
        plain = await client.post("/v1/completions", json={**base, "max_tokens": 2, "ignore_eos": True, "echo": False})
        no_echo_zero = await client.post("/v1/completions", json={**base, "max_tokens": 0, "echo": False})
        return text, zero, two, plain, no_echo_zero

    text, zero, two, plain, no_echo_zero = serve(tiny, scenario)
    z = zero.json()
    assert zero.status_code == 200 and z["choices"][0]["text"] == text
    assert z["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 0, "total_tokens": len(PROMPT)}
    assert z["choices"][0]["finish_reason"] == "length"
    assert z["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(reference_logprobs, abs=2e-4)
    assert two.json()["choices"][0]["text"] == text + plain.json()["choices"][0]["text"]
    assert no_echo_zero.status_code == 400 and no_echo_zero.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_equals_the_non_streamed_answer(tiny):
    async def scenario(client):
        body = {"model": NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": 4, "ignore_eos": True,
                "logprobs": 2, "echo": True}
        whole = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        chunks = []
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0])
        return whole, chunks

    whole, chunks = serve(tiny, scenario)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = {k: sum((c["logprobs"][k] for c in chunks), []) for k in ("tokens", "token_logprobs", "text_offset")}
    assert streamed == {k: whole["logprobs"][k] for k in streamed}
    assert chunks[-1]["finish_reason"] == "length"


def test_prompt_logprobs_field(tiny, reference_logprobs):
    async def scenario(client):
        return await client.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 1,
                                                          "prompt_logprobs": 3})

    r = serve(tiny, scenario)
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(PROMPT) and plp[0] is None
    for i, pos in enumerate(plp[1:], start=1):
        assert pos[str(PROMPT[i])]["logprob"] == pytest.approx(reference_logprobs[i - 1], abs=2e-4)
        assert sum(1 for v in pos.values() if v["rank"] <= 3) == 3  # the top 3 (and the prompt token)


def test_tokenizer_info_health_and_the_remote_tokenizer_calls(tiny):
    """lm-eval's remote tokenizer reads /tokenizer_info (needs eos_token), then /tokenize with
    add_special_tokens false and /detokenize."""

    async def scenario(client):
        info = await client.get("/tokenizer_info")
        health = await client.get("/health")
        eos = await client.post("/tokenize", json={"prompt": info.json()["eos_token"], "add_special_tokens": False})
        words = await client.post("/tokenize", json={"prompt": "w7 w9", "add_special_tokens": False})
        back = await client.post("/detokenize", json={"tokens": words.json()["tokens"]})
        return info, health, eos, words, back

    info, health, eos, words, back = serve(tiny, scenario)
    i = info.json()
    assert info.status_code == 200 and i["eos_token"] == "</s>" and i["bos_token"] == "<s>"
    assert i["model_max_length"] == 256 and i["vocab_size"] == 384
    assert health.status_code == 200 and health.headers["content-type"] == "application/json"
    assert health.json() == {"status": "ok"}  # before: an empty body without a content type
    assert eos.json()["tokens"] == [2] and words.json()["tokens"] == [7, 9]
    assert back.json()["prompt"] == "w7 w9"


def test_openapi_lists_the_statuses_the_server_answers(tiny):
    """Before: only 200 and 422 were listed, while the server answers 400/404/413/503 and never 422."""

    async def scenario(client):
        return (await client.get("/openapi.json")).json()

    schema = serve(tiny, scenario)
    for path in ("/v1/completions", "/v1/chat/completions"):
        statuses = set(schema["paths"][path]["post"]["responses"])
        assert {"200", "400", "404", "413", "503"} <= statuses and "422" not in statuses, (path, statuses)
    assert "ErrorResponse" in schema["components"]["schemas"]
    assert "503" in schema["paths"]["/health"]["get"]["responses"]


def test_admission_counts_prompts_times_n(tiny):
    """--max-waiting-requests 0 with max_num_seqs 4: a running request with n = 3 holds three of the four
    slots, so one with n = 2 must wait (503). Before: admission counted prompts, one slot each."""

    async def scenario(client):
        hold = {"model": NAME, "prompt": PROMPT, "n": 3, "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=hold) as held:
            assert held.status_code == 200
            second = await client.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "n": 2,
                                                                "max_tokens": 1})
        too_big = await client.post("/v1/completions", json={"model": NAME, "prompt": [PROMPT] * 3, "n": 2,
                                                             "max_tokens": 1})
        after = await client.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "n": 2, "max_tokens": 1})
        return second, too_big, after

    second, too_big, after = serve(tiny, scenario, max_num_seqs=4, max_waiting_requests=0)
    assert second.status_code == 503 and second.json()["error"]["code"] == "queue_full"
    assert too_big.status_code == 400 and "6 sequences" in too_big.json()["error"]["message"]
    assert after.status_code == 200 and len(after.json()["choices"]) == 2


def test_tokenizing_a_large_body_does_not_stall_the_event_loop(tiny):
    """Before: /tokenize and prompt tokenization ran on the event loop (and the Rust tokenizer's `encode`
    holds the GIL throughout); a body of a few MiB froze every open stream for as long as the tokenizer
    took. A ticker on the serving loop measures its longest pause."""
    from turbollm.tokenizer import load_tokenizer

    text = " ".join(f"w{4 + i % 380}" for i in range(600_000))  # ~3 MiB
    tok = load_tokenizer(str(tiny))
    t0 = time.perf_counter()
    tok.encode(text)
    encode_s = time.perf_counter() - t0

    async def scenario(client):
        gaps, done = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        r = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        took = time.perf_counter() - t0
        done.set()
        await tick
        return r, took, max(gaps)

    r, took, worst = serve_in_loop(tiny, scenario)
    assert r.status_code == 200 and r.json()["count"] == 600_000
    assert encode_s > 0.2, f"the body encodes in {encode_s:.3f} s: too fast to show a stall"
    assert worst < max(0.1, encode_s / 3), (
        f"the event loop paused {worst:.3f} s while a {encode_s:.3f} s tokenization ran (request {took:.2f} s)")
    assert not math.isnan(worst)


def test_logit_bias_is_applied_and_checked(tiny):
    """Before: `logit_bias` was silently ignored (an unknown field); now a bias of 100 decides every greedy
    token, and keys outside the vocabulary or values outside [-100, 100] are a 400 naming the field."""

    async def scenario(client):
        body = {"model": NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": 4, "ignore_eos": True}
        forced = await client.post("/v1/completions", json={**body, "logit_bias": {"77": 100}, "logprobs": 0})
        bad = [await client.post("/v1/completions", json={**body, "logit_bias": b})
               for b in ({"99999": 5}, {"x": 5}, {"5": 250}, {"-1": 1})]
        return forced, bad

    forced, bad = serve(tiny, scenario)
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["text"].split() == ["w77"] * 4
    for r in bad:
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
