"""The browser tests' harness (test_webui_browser.py, test_webui_failures.py): one `turbollm serve smollm2-135m`
process with an API key (`webui_server`, for the whole session), Debian's chromium through Playwright (`chromium`,
per module: Playwright's sync API holds an event loop while it runs), both registered by tests/conftest.py; a
`Page` per test with the network to anywhere but the server blocked (a request elsewhere fails the test, as does an
uncaught error on the page), and the measurements the tests share. Screenshots go to tests/artifacts/webui/ (or
$TURBOLLM_TEST_ARTIFACTS/webui/).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from conftest import STRICT_HOW, catalog_model_path, free_port, serve_process, strict_mode

KEY = "webui-key"
MAX_LEN = 4096
ARTIFACTS = Path(os.environ.get("TURBOLLM_TEST_ARTIFACTS", Path(__file__).parent / "artifacts")) / "webui"
SETTINGS_KEY = "turbollm.settings.v1"
CONV_KEY = "turbollm.conversations.v1"


def expect(locator):
    from playwright.sync_api import expect as pw_expect

    return pw_expect(locator)


def _missing(reason: str):
    if strict_mode():
        pytest.fail(f"{reason} ({STRICT_HOW}; `make browser` installs Debian's chromium)", pytrace=False)
    pytest.skip(reason)


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    """`turbollm serve smollm2-135m` on `port` (one thread: the other core is the browser's), healthy."""
    return serve_process([str(catalog_model_path("smollm2-135m")), "--served-model-name", "smollm2-135m",
                          "--threads", "1", "--max-model-len", str(MAX_LEN), "--kv-cache-memory", "0.25",
                          "--api-key", KEY], port, log_path)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def webui_server(tmp_path_factory):
    port = free_port()
    proc = start_server(port, tmp_path_factory.mktemp("webui") / "server.log")
    yield {"base": f"http://127.0.0.1:{port}", "proc": proc}
    stop_server(proc)


@pytest.fixture(scope="module")  # not the session: Playwright's sync API holds an event loop until it stops
def chromium():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        _missing(f"playwright is not installed ({e}); it is in the test extras")
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        _missing("Debian's chromium is not installed")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield b
        b.close()


class Page:
    """A browser context on the server with everything else blocked, and helpers over its page."""

    def __init__(self, browser, base: str, key: str | None = KEY, viewport=(1100, 760)):
        self.base = base
        self.blocked: list[str] = []
        self.errors: list[str] = []
        self.ctx = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]}, accept_downloads=True,
                                       permissions=["clipboard-read", "clipboard-write"])
        self.ctx.route("**/*", self._route)
        if key is not None:  # the page's own settings, as if the key had been typed once before
            self.ctx.add_init_script(f"if (!localStorage.getItem('{SETTINGS_KEY}')) "
                                     f"localStorage.setItem('{SETTINGS_KEY}', JSON.stringify({{api_key: '{key}'}}));")
        self.page = self.ctx.new_page()
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def _route(self, route):
        if route.request.url.startswith(self.base + "/"):
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort("blockedbyclient")

    def open(self, path: str = "/"):
        self.page.goto(self.base + path)
        self.page.locator("body[data-ready='1']").wait_for(timeout=20000)
        return self

    def close(self):
        self.ctx.close()
        assert not self.blocked, f"the page tried to reach beyond the server: {self.blocked}"
        assert not self.errors, f"uncaught errors on the page: {self.errors}"

    def tid(self, name: str):
        return self.page.locator(f"[data-testid={name}]")

    def send(self, text: str):
        self.tid("prompt").fill(text)
        self.tid("prompt").press("Enter")

    def last_reply(self):
        return self.page.locator(".message.assistant").last

    def wait_done(self, timeout: float = 60):
        """Until the last reply has its stats or its error, and Send is back."""
        self.last_reply().locator("[data-testid=stats], [data-testid=message-error]").first.wait_for(timeout=timeout * 1000)
        self.tid("send").wait_for(state="visible", timeout=5000)

    def settings(self, **values):
        if self.page.locator("#settings").get_attribute("open") is None:
            self.page.locator("#settings summary").click()
        for k, v in values.items():
            self.tid(f"set-{k}").fill(str(v))

    def storage(self, key: str):
        return self.page.evaluate("k => localStorage.getItem(k)", key)

    def shot(self, name: str):
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


@pytest.fixture
def ui(chromium, webui_server):
    pages: list[Page] = []

    def make(**kw) -> Page:
        p = Page(chromium, webui_server["base"], **kw)
        pages.append(p)
        return p

    yield make
    for p in pages:
        p.close()


def stats(server) -> dict:
    return httpx.get(server["base"] + "/stats", timeout=10).json()


def aborted(server) -> float:
    text = httpx.get(server["base"] + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r'request_success_total\{finished_reason="abort"[^}]*\} (\S+)', text))


def api_ttft(server, content: str, max_tokens: int = 8) -> float:
    """Seconds from sending a streamed chat request to its first content piece, measured by this process."""
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", server["base"] + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return time.perf_counter() - t0
    raise AssertionError("no content in the stream")


WATCH = """() => {
  const t = window.__t = {updates: 0};
  if (!window.__fetch0) {  // the chat request's own timing: fetch called (t.fetch), first content byte in (t.recv)
    window.__fetch0 = window.fetch;
    window.fetch = async (...a) => {
      const w = window.__t, chat = String(a[0]).endsWith('/v1/chat/completions');
      if (chat && w.fetch === undefined) w.fetch = performance.now();
      const r = await window.__fetch0(...a);
      if (!chat || !r.body) return r;
      const [mine, page] = r.body.tee();
      (async () => {  // reads its copy up to the first content piece, then lets go (the page's copy alone left)
        const rd = mine.getReader(), dec = new TextDecoder();
        let buf = '';
        try {
          for (;;) {
            const {value, done} = await rd.read();
            if (done) return;
            buf += dec.decode(value, {stream: true});
            if (/"content": *"[^"]/.test(buf)) { if (w.recv === undefined) w.recv = performance.now(); break; }
          }
          await rd.cancel();
        } catch (e) { /* stopped: the page's copy says so */ }
      })();
      return new Response(page, {status: r.status, statusText: r.statusText, headers: r.headers});
    };
  }
  document.getElementById('prompt').addEventListener('keydown', (e) => { if (e.key === 'Enter') t.sent = performance.now(); },
                                                     {capture: true, once: true});
  const box = document.getElementById('messages');
  new MutationObserver(() => {
    const el = box.querySelector('.message.assistant:last-of-type .content');
    if (!el || !el.textContent.trim() || t.done) return;
    if (box.querySelector('.message.assistant:last-of-type [data-testid=stats]')) { t.done = true; return; }
    t.updates++;
    if (t.first === undefined) { t.first = null; requestAnimationFrame(() => { t.first = performance.now(); }); }
  }).observe(box, {subtree: true, childList: true, characterData: true});
}"""
