"""`turbollm proxy` over real `turbollm serve` processes: a prefill instance (p2p kv_producer), a decode instance
(kv_consumer; one hand-off over HTTP as from another host) and, beside them, one plain instance as the reference.
Greedy completions and chats through the proxy — streamed or not, with logprobs — equal the plain instance's; a
prefill instance that dies leaves the requests to the decode instance (counted, same output); a decode instance
that dies mid-stream ends the stream with an error event; a proxy started on a URL that does not answer says which
flag. No process is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port, serve_process
from quant_tiny import add_chat_template, build_tiny

pytestmark = pytest.mark.slow  # four server processes


def _p2p(role: str, buf) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "p2p", "kv_role": role, "kv_buffer_path": str(buf)})]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    model = str(add_chat_template(build_tiny("llama", root / "m")))
    common = [model, "--threads", "1", "--kv-cache-memory", "0.02", "--no-webui"]
    procs, urls = {}, {}
    try:
        # (the decode instance's buffer folder is not the prefill instance's: a hand-off names its file and pool by
        # their own paths)
        for name, extra in (("prefill", _p2p("kv_producer", root / "buf")),
                            ("decode", _p2p("kv_consumer", root / "other-host")), ("plain", [])):
            port = free_port()
            procs[name] = serve_process(common + extra, port, root / f"{name}.log")
            urls[name] = f"http://127.0.0.1:{port}"
        port = free_port()
        with open(root / "proxy.log", "w") as log:
            procs["proxy"] = subprocess.Popen([sys.executable, "-m", "turbollm", "proxy", "--prefill", urls["prefill"],
                                               "--decode", urls["decode"], "--port", str(port)],
                                              stdout=log, stderr=subprocess.STDOUT)
        urls["proxy"] = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(urls["proxy"] + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield model, urls, procs, root
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=20)


def _complete(url: str, model: str, **kw) -> dict:
    body = {"model": model, "prompt": "the quick brown fox jumps over", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 2, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith((name + " ", name + "{"))))


def test_completions_and_chat_through_the_proxy_equal_one_instance(cluster):
    model, urls, _, _ = cluster
    want, got = _complete(urls["plain"], model), _complete(urls["proxy"], model)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 12
    chat = {"model": model, "messages": [{"role": "user", "content": "count to five"}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    w = httpx.post(urls["plain"] + "/v1/chat/completions", json=chat, timeout=120).json()
    g = httpx.post(urls["proxy"] + "/v1/chat/completions", json=chat, timeout=120).json()
    assert g["choices"][0]["message"] == w["choices"][0]["message"]
    assert g["choices"][0]["logprobs"] == w["choices"][0]["logprobs"]
    streamed = "".join(e["choices"][0]["text"] for e in _stream(urls["proxy"], "/v1/completions", {
        "model": model, "prompt": "the quick brown fox jumps over", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}) if e.get("choices"))
    assert streamed == want["choices"][0]["text"]
    stop = _complete(urls["proxy"], model, stop=[want["choices"][0]["text"][3:6]])  # a stop string mid-output
    assert stop["choices"][0] == _complete(urls["plain"], model, stop=[want["choices"][0]["text"][3:6]])["choices"][0]
    assert _metric(urls["proxy"], "turbollm_proxy:prefilled_remotely_total") >= 4
    assert _metric(urls["decode"], "turbollm:kv_bundles_received_total") >= 4
    assert _metric(urls["decode"], "turbollm:kv_remote_fallbacks_total") == 0
    assert _metric(urls["proxy"], "turbollm_proxy:prefill_fallbacks_total") == 0
    # a decode instance on another host: the hand-off's path is not there, the blocks come as a bundle from the
    # prefill instance's server (GET /kv_transfer/..., built from its pool), and the output is the same
    h = httpx.post(urls["prefill"] + "/v1/completions", timeout=120, json={
        "model": model, "prompt": "the quick brown fox jumps over", "max_tokens": 1, "temperature": 0,
        "ignore_eos": True, "logprobs": 2, "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    local = Path(h["remote_bundle"])
    far = dict(h, remote_bundle=f"/no-such-host-path/{local.parent.name}/{local.name}", remote_url=urls["prefill"])
    received = _metric(urls["decode"], "turbollm:kv_bundles_received_total")
    got = _complete(urls["decode"], model, kv_transfer_params=far)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]
    assert _metric(urls["decode"], "turbollm:kv_bundles_received_total") == received + 1
    assert _metric(urls["decode"], "turbollm:kv_remote_fallbacks_total") == 0
    assert not local.exists()  # taken by the server, which released the blocks
    # each instance's KV-transfer series through the proxy's /metrics, labelled by instance and role
    text = httpx.get(urls["proxy"] + "/metrics", timeout=10).text
    sent = [ln for ln in text.splitlines() if ln.startswith("turbollm_proxy:instance_kv_bundles_sent_total{")]
    assert len(sent) == 2 and any('role="prefill"' in ln and float(ln.split()[-1]) >= 5 for ln in sent)
    assert 'turbollm_proxy:instance_kv_transfer_seconds_bucket{' in text and 'role="decode"' in text


def test_a_dead_decode_instance_ends_the_stream_with_an_error(cluster):
    model, urls, procs, root = cluster
    # (a second decode instance, killed mid-stream; the proxy in front of it alone)
    port = free_port()
    victim = serve_process([model, "--threads", "1", "--kv-cache-memory", "0.02", "--no-webui",
                            *_p2p("kv_consumer", root / "buf")], port, root / "victim.log")
    pport = free_port()
    with open(root / "proxy2.log", "w") as log:
        proxy = subprocess.Popen([sys.executable, "-m", "turbollm", "proxy", "--prefill", urls["prefill"],
                                  "--decode", f"http://127.0.0.1:{port}", "--port", str(pport)],
                                 stdout=log, stderr=subprocess.STDOUT)
    try:
        purl = f"http://127.0.0.1:{pport}"
        for _ in range(200):
            try:
                if httpx.get(purl + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        body = {"model": model, "prompt": "a long one", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True}
        t0, lines = time.monotonic(), []
        with httpx.stream("POST", purl + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                if len(lines) == 3:  # frozen mid-stream, then killed
                    victim.send_signal(signal.SIGSTOP)
                    victim.send_signal(signal.SIGKILL)
        assert time.monotonic() - t0 < 60
        assert lines[-1] == "data: [DONE]" and "failed mid-stream" in lines[-2] and len(lines) < 150
        assert _metric(purl, "turbollm_proxy:decode_failures_total") == 1
    finally:
        for p in (proxy, victim):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=20)


def test_a_dead_prefill_instance_leaves_the_prefill_to_the_decode_instance(cluster):
    model, urls, procs, _ = cluster
    want = _complete(urls["plain"], model)
    procs["prefill"].send_signal(signal.SIGKILL)
    procs["prefill"].wait(timeout=20)
    got = _complete(urls["proxy"], model)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert _metric(urls["proxy"], "turbollm_proxy:prefill_fallbacks_total") >= 1


def test_a_proxy_url_that_does_not_answer_is_named_at_start():
    from turbollm.cli.proxy_cmd import wait_for_instances
    from turbollm.errors import TurboLLMError

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TurboLLMError, match=f"--decode {url}: no answer within 1 s"):
        wait_for_instances({"--decode": [url]}, 1.0)
    with pytest.raises(TurboLLMError, match="not an http"):
        wait_for_instances({"--prefill": ["localhost:8000"]}, 1.0)


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_serve_disaggregate_starts_pinned_instances_and_stops_them_all(cluster, tmp_path):
    model, urls, _, _ = cluster
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("the launcher test needs 2 cores")
    want = _complete(urls["plain"], model)
    port = free_port()
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "turbollm", "serve", model, "--disaggregate", "1:1",
                                     "--kv-cache-memory", "0.02", "--no-webui", "--port", str(port)],
                                    stdout=log, stderr=subprocess.STDOUT)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while True:
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the launcher's proxy never answered"
            time.sleep(0.25)
        got = _complete(f"http://127.0.0.1:{port}", model)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        children = _children(launcher.pid)
        roles, cores = [], []
        for pid in children:
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().split("\0")
            roles.append(json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_role"])
            cores.append(os.sched_getaffinity(pid))
        assert sorted(roles) == ["kv_consumer", "kv_producer"]
        assert len(cores) == 2 and not cores[0] & cores[1]  # each on its own cores
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=20)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_disaggregate_refuses_what_it_cannot_split():
    from turbollm.cli.disaggregate import core_groups, parse_split
    from turbollm.errors import TurboLLMError

    assert parse_split("1:2") == (1, 2) and core_groups([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    for bad, message in (("2", "expected P:D"), ("0:1", "at least one")):
        with pytest.raises(TurboLLMError, match=message):
            parse_split(bad)
    with pytest.raises(TurboLLMError, match="need at least 3 cores"):
        core_groups([0, 1], 3)
