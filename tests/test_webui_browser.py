"""The chat page and the dashboard in a real browser: Playwright driving Debian's chromium (`make browser`)
against a real `turbollm serve smollm2-135m` process with an API key.

Every page runs with the network to anywhere but the server blocked (a request elsewhere fails the test).
Checked: the page loads all its files and nothing else (their bytes are printed); tokens stream onto the
screen, and the first one is on screen within 100 ms of the API's own TTFT (medians of 3, same prompt
length); stop aborts the request on the server; regenerate and edit-and-resend; settings reach the request
and survive a reload; conversations survive a reload, are renamed, deleted, exported and imported; a
401, a prompt over the context, a 503 with Retry-After, a stream that ends early, a server killed
mid-reply (then back on its port) and corrupt stored data are shown as what they are and the
conversation stays usable; a 200-message conversation keeps every frame
under 100 ms while a reply streams; the dashboard's counters move without a reload; a narrow window.
`test_stream_check_can_fail` serves the page with its stream handler removed and sees the check fail.
Screenshots of each view go to tests/artifacts/webui/ (or $TURBOLLM_TEST_ARTIFACTS/webui/).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from conftest import STRICT_HOW, catalog_model_path, free_port, serve_process, strict_mode

httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.model, pytest.mark.slow]

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    proc = start_server(port, tmp_path_factory.mktemp("webui") / "server.log")
    yield {"base": f"http://127.0.0.1:{port}", "proc": proc}
    stop_server(proc)


@pytest.fixture(scope="module")
def browser():
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
def ui(browser, server):
    pages: list[Page] = []

    def make(**kw) -> Page:
        p = Page(browser, server["base"], **kw)
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


def test_page_loads_from_the_server_alone(ui, server):
    props = httpx.get(server["base"] + "/props").json()
    p = ui()
    sizes: dict[str, int] = {}
    p.page.on("response", lambda r: sizes.__setitem__(r.url, len(r.body())) if r.url.startswith(server["base"] + "/static")
              or r.url == server["base"] + "/" else None)
    p.open()
    assert p.tid("model-name").inner_text().startswith("smollm2-135m")
    p.page.wait_for_timeout(300)
    print(f"\nthe page at /: {sum(sizes.values())} bytes in {len(sizes)} files; /props says {props['webui_bytes']}")
    assert sum(sizes.values()) == props["webui_bytes"] and len(sizes) >= 5  # every file it ships, nothing else
    assert props["api_key_required"] is True


def test_stream_ttft_regenerate_edit_and_reload(ui, server):
    p = ui().open()
    p.settings(temperature=0, max_tokens=8)
    page_ttft, ref_ttft = [], []
    for i, name in enumerate(["Ann", "Bob", "Cid"]):
        p.tid("new-chat").click()
        p.page.evaluate(WATCH)
        p.send(f"Say hello to {name}, who is {20 + i} years old.")
        p.wait_done()
        t = p.page.evaluate("window.__t")
        assert t.get("sent") is not None and t.get("first") is not None, f"no token reached the screen: {t}"
        page_ttft.append((t["first"] - t["sent"]) / 1e3)
        ref_ttft.append(api_ttft(server, f"Say hello to {name}x, who is {30 + i} years old."))
    on_screen, api = statistics.median(page_ttft), statistics.median(ref_ttft)
    print(f"\ntyping to first token on screen: median {1e3 * on_screen:.0f} ms; API TTFT: median {1e3 * api:.0f} ms")
    assert on_screen <= api + 0.100, (page_ttft, ref_ttft)

    # tokens stream (many screen updates), with the reply's stats
    p.settings(max_tokens=48)
    p.tid("new-chat").click()
    p.page.evaluate(WATCH)
    p.send("List five fruits, one per line.")
    p.wait_done()
    assert p.page.evaluate("window.__t.updates") >= 5
    stats_text = p.last_reply().locator("[data-testid=stats]").inner_text()
    assert re.search(r"\d+ tokens · TTFT \d+ ms · [\d.]+ tok/s · prompt \d+ \(\d+ from cache\)", stats_text), stats_text
    first_reply = p.last_reply().locator("[data-testid=content]").inner_text()
    assert first_reply.strip()
    p.shot("chat")

    # regenerate: the same conversation sent again without the old reply
    with p.page.expect_request("**/v1/chat/completions") as req:
        p.last_reply().locator("[data-testid=regenerate]").click()
    sent = req.value.post_data_json
    assert sent["messages"][-1] == {"role": "user", "content": "List five fruits, one per line."}
    p.wait_done()
    assert p.page.locator(".message").count() == 2

    # edit and resend: what followed the edited message is replaced
    p.page.locator(".message.user [data-testid=edit]").click()
    p.tid("edit-box").fill("List three colors, one per line.")
    with p.page.expect_request("**/v1/chat/completions") as req:
        p.tid("edit-send").click()
    assert req.value.post_data_json["messages"] == [{"role": "user", "content": "List three colors, one per line."}]
    p.wait_done()
    assert p.page.locator(".message").count() == 2
    reply = p.last_reply().locator("[data-testid=content]").inner_text()

    # reload: the conversations and the settings are still there
    p.page.reload()
    p.page.locator("body[data-ready='1']").wait_for()
    titles = p.tid("conversation").all_inner_texts()
    assert titles[0].startswith("List five fruits") and len(titles) >= 4
    p.tid("conversation").first.click()
    assert p.page.locator(".message.user").inner_text().startswith("List three colors")
    assert p.last_reply().locator("[data-testid=content]").inner_text() == reply
    assert p.tid("set-max_tokens").input_value() == "48"


def test_settings_reach_the_request(ui, server):
    p = ui().open()
    p.settings(temperature=0.3, top_p=0.9, top_k=5, max_tokens=12, seed=7)
    p.tid("set-system").fill("You answer in one word.")
    with p.page.expect_request("**/v1/chat/completions") as req:
        p.send("What color is the sky?")
    body = req.value.post_data_json
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"], body["seed"]) == (0.3, 0.9, 5, 12, 7)
    assert body["messages"][0] == {"role": "system", "content": "You answer in one word."} and body["stream"] is True
    assert req.value.headers["authorization"] == f"Bearer {KEY}"
    p.wait_done()
    n = p.last_reply().locator("[data-testid=stats]").inner_text()
    assert int(n.split(" tokens")[0]) <= 12
    # the server's defaults come back with one click
    p.tid("reset-settings").click()
    props = httpx.get(server["base"] + "/props").json()["defaults"]
    assert float(p.tid("set-temperature").input_value()) == props["temperature"]
    assert p.tid("set-max_tokens").input_value() == ""


def test_stop_aborts_on_the_server(ui, server):
    p = ui().open()
    p.settings(temperature=0, max_tokens=2000)
    before = aborted(server)
    p.send("Count from 1 to 500, one number per line.")
    content = p.last_reply().locator("[data-testid=content]")
    deadline = time.monotonic() + 30
    while len(content.inner_text()) < 20 and time.monotonic() < deadline:  # a few lines of the count
        time.sleep(0.05)
    assert p.tid("stop").is_visible(), "the reply ended before Stop could be pressed"
    p.tid("stop").click()
    p.wait_done()
    assert "stopped" in p.last_reply().locator("[data-testid=stats]").inner_text()
    deadline = time.monotonic() + 10
    while (stats(server)["totals"]["running"] or aborted(server) == before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats(server)["totals"]["running"] == 0 and aborted(server) == before + 1
    kept = p.last_reply().locator("[data-testid=content]").inner_text()
    assert kept.strip()
    p.page.reload()
    p.page.locator("body[data-ready='1']").wait_for()
    assert p.last_reply().locator("[data-testid=content]").inner_text() == kept  # the partial reply is kept


def test_conversations_rename_delete_export_import(ui, server, tmp_path):
    p = ui().open()
    p.settings(temperature=0, max_tokens=4)
    p.send("Name a planet.")
    p.wait_done()
    first = p.tid("conversation").first
    first.locator("xpath=..").locator("[data-act=rename]").click()
    p.tid("rename-input").fill("Planets")
    p.tid("rename-input").press("Enter")
    assert p.tid("conversation").first.inner_text() == "Planets"
    with p.page.expect_download() as dl:
        p.tid("export").click()
    exported = tmp_path / "chats.json"
    dl.value.save_as(exported)
    data = json.loads(exported.read_text())
    assert data["version"] == 1 and data["conversations"][0]["title"] == "Planets"
    n = p.tid("conversation").count()
    delete = p.tid("conversation").first.locator("xpath=..").locator("[data-act=delete]")
    delete.click()
    delete.click()  # the second click confirms
    assert p.tid("conversation").count() == n - 1
    assert "Planets" not in p.tid("conversation").all_inner_texts()
    p.page.locator("#import-chats").set_input_files(str(exported))
    expect(p.tid("banner")).to_contain_text("Imported 1 conversation")
    assert "Planets" in p.tid("conversation").all_inner_texts()
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    p.page.locator("#import-chats").set_input_files(str(bad))
    expect(p.tid("banner")).to_contain_text("Import failed")
    assert "Planets" in p.tid("conversation").all_inner_texts()


def test_errors_are_shown_and_the_conversation_stays_usable(ui, server):
    # no API key yet: the 401 says what to do; with the key, regenerate works
    p = ui(key=None).open()
    p.settings(temperature=0, max_tokens=4)
    p.send("Hello there.")
    p.wait_done()
    err = p.last_reply().locator("[data-testid=message-error]").inner_text()
    assert "401" in err and "API key" in err
    p.settings(api_key=KEY)
    p.last_reply().locator("[data-testid=regenerate]").click()
    p.wait_done()
    assert p.last_reply().locator("[data-testid=message-error]").count() == 0

    # a prompt over the context: the server's 400, then an edit makes it fit
    p.send("word " * (MAX_LEN + 100))
    p.wait_done()
    err = p.last_reply().locator("[data-testid=message-error]").inner_text()
    assert "400" in err and "maximum context length" in err
    p.page.locator(".message.user [data-testid=edit]").last.click()
    p.tid("edit-box").fill("Say yes.")
    p.tid("edit-send").click()
    p.wait_done()
    assert p.last_reply().locator("[data-testid=message-error]").count() == 0

    # a 503 with Retry-After, then a stream that drops before [DONE]
    def busy(route):
        route.fulfill(status=503, headers={"Retry-After": "2", "Content-Type": "application/json"},
                      body=json.dumps({"error": {"message": "the server is at capacity", "type": "server_error",
                                                 "code": "queue_full"}}))

    p.page.route("**/v1/chat/completions", busy)
    p.send("Are you there?")
    p.wait_done()
    err = p.last_reply().locator("[data-testid=message-error]").inner_text()
    assert "503" in err and "at capacity" in err and "retry after 2 s" in err
    p.page.unroute("**/v1/chat/completions")

    def dropped(route):
        chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Par"}}]}
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=f"data: {json.dumps(chunk)}\n\n")

    p.page.route("**/v1/chat/completions", dropped)
    p.last_reply().locator("[data-testid=regenerate]").click()
    p.wait_done()
    assert "connection closed before the reply finished" in p.last_reply().locator("[data-testid=message-error]").inner_text()
    assert p.last_reply().locator("[data-testid=content]").inner_text() == "Par"  # what arrived is kept
    p.page.unroute("**/v1/chat/completions")
    p.last_reply().locator("[data-testid=regenerate]").click()
    p.wait_done()
    assert p.last_reply().locator("[data-testid=message-error]").count() == 0
    p.shot("chat-errors")

    # corrupt stored conversations: set aside under another key, said on the page, nothing else lost
    p.page.evaluate("([k, v]) => localStorage.setItem(k, v)", [CONV_KEY, '{"version": 1, "conversations": [tru'])
    p.page.reload()
    p.page.locator("body[data-ready='1']").wait_for()
    banner = p.tid("banner").inner_text()
    key = re.search(r'under "([^"]+)"', banner).group(1)
    assert "could not be read" in banner and p.storage(key) == '{"version": 1, "conversations": [tru'
    p.send("Say hi.")
    p.wait_done()
    assert p.last_reply().locator("[data-testid=message-error]").count() == 0


def test_long_conversation_stays_responsive(ui, server):
    msgs = []
    for i in range(100):
        msgs.append({"role": "user", "content": f"Note {i}: **fox**."})
        msgs.append({"role": "assistant", "content": f"`{i}`:\n- one"})
    msgs[-1]["content"] = "Here:\n```python\nprint('fox')\n```"
    conv = {"id": "long", "title": "Two hundred messages", "system": "", "messages": msgs}
    p = ui().open()
    p.page.evaluate("([k, v]) => localStorage.setItem(k, v)", [CONV_KEY, json.dumps({"version": 1, "conversations": [conv]})])
    p.page.reload()
    p.page.locator("body[data-ready='1']").wait_for()
    p.settings(temperature=0, max_tokens=64)
    assert p.page.locator(".message").count() == 200
    copy = p.page.locator(".message.assistant").last.locator("[data-testid=copy-code]")  # code blocks copy
    copy.click()
    expect(copy).to_have_text("Copied")
    assert p.page.evaluate("navigator.clipboard.readText()") == "print('fox')"
    p.page.evaluate("""() => {
      const f = window.__frames = {max: 0, n: 0, long: 0, on: true};
      let last = null;
      const tick = (t) => { if (last !== null) f.max = Math.max(f.max, t - last); last = t; f.n++; if (f.on) requestAnimationFrame(tick); };
      requestAnimationFrame(tick);
      new PerformanceObserver((l) => { for (const e of l.getEntries()) f.long = Math.max(f.long, e.duration); })
        .observe({type: 'longtask'});
    }""")
    p.send("Write one more note about the fox.")
    p.wait_done(timeout=120)
    f = p.page.evaluate("window.__frames.on = false, window.__frames")
    toks = p.last_reply().locator("[data-testid=stats]").inner_text()
    print(f"\n200-message conversation, streaming ({toks}): {f['n']} frames, longest {f['max']:.0f} ms, "
          f"longest task {f['long']:.0f} ms")
    assert p.last_reply().locator("[data-testid=message-error]").count() == 0, \
        p.last_reply().locator("[data-testid=message-error]").inner_text()
    assert p.page.locator(".message").count() == 202 and f["n"] > 30
    assert f["max"] <= 100 and f["long"] <= 100, f


def test_dashboard_counters_move(ui, server):
    p = ui().open("/dashboard")
    assert p.page.locator("#view-dashboard").is_visible() and not p.page.locator("#view-chat").is_visible()
    tile = p.tid("tile-generation-tokens")
    tile.wait_for()
    before = int(tile.inner_text())
    n_loads = p.page.evaluate("performance.getEntriesByType('navigation').length")
    r = httpx.post(server["base"] + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "smollm2-135m", "messages": [{"role": "user", "content": "Tell me about dashboards."}],
                         "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 24  # 24 more tokens on the server
    deadline = time.monotonic() + 10
    while int(tile.inner_text()) < before + 24 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert int(tile.inner_text()) >= before + 24
    rows = p.tid("latency-table").locator("tbody tr")
    assert rows.count() == 2 and int(rows.first.locator("td").first.inner_text()) > 0
    assert p.tid("kv-table").locator("tbody tr").first.inner_text().split()[1] == "full_attention"
    assert p.page.evaluate("performance.getEntriesByType('navigation').length") == n_loads  # no reload
    p.page.wait_for_timeout(1500)
    p.shot("dashboard")
    p.tid("tab-chat").click()  # back to the chat without a reload
    assert p.tid("prompt").is_visible() and p.page.url.endswith("/")


def test_narrow_window(ui, server):
    p = ui(viewport=(390, 760)).open()
    assert not p.page.locator("#sidebar").is_visible() and p.tid("prompt").is_visible()
    p.page.locator("#toggle-sidebar").click()
    assert p.tid("new-chat").is_visible()
    p.tid("new-chat").click()
    p.page.locator("#toggle-sidebar").click()
    p.tid("prompt").focus()
    p.page.keyboard.type("Hi")
    p.page.keyboard.press("Shift+Enter")  # a line break, not a send
    p.page.keyboard.type("there")
    assert p.tid("prompt").input_value() == "Hi\nthere" and p.page.locator(".message").count() == 0
    p.shot("chat-narrow")


def test_stream_check_can_fail(ui, server):
    """The same page with its stream handler removed: the streaming check above must fail on it."""
    p = ui()
    api_js = httpx.get(server["base"] + "/static/api.js").text
    broken = api_js.replace("onDelta(c.delta.content)", "void 0")
    assert broken != api_js
    p.page.route("**/static/api.js", lambda r: r.fulfill(status=200, body=broken, content_type="text/javascript"))
    p.open()
    p.settings(temperature=0, max_tokens=8)
    p.page.evaluate(WATCH)
    p.send("Say hello.")
    p.wait_done()
    assert p.page.evaluate("window.__t.updates") == 0 and p.page.evaluate("window.__t.first") is None
    assert p.last_reply().locator("[data-testid=content]").inner_text().strip() == ""


MARKDOWN_CASES = [
    # (source, fragments the HTML must hold, fragments it must not)
    ("<script>alert(1)</script> & <b>x</b>", ["&lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;b&gt;x&lt;/b&gt;"], ["<script", "<b>"]),
    ("**bold** and *it* and `a<b>`", ["<strong>bold</strong>", "<em>it</em>", "<code>a&lt;b&gt;</code>"], []),
    ("```python\ndef f(x):  # add\n    return 'a' + 1\n```",
     ['<span class="tok-keyword">def</span>', '<span class="tok-comment"># add</span>',
      "<span class=\"tok-string\">&#39;a&#39;</span>", '<span class="tok-number">1</span>', 'data-testid="copy-code"'], []),
    ("```js\nlet s = \"<img src=x onerror=alert(1)>\";", ['<span class="tok-keyword">let</span>', "&lt;img src=x"], ["<img"]),
    ("[ok](https://example.org/a?b=1&c=2) [bad](javascript:alert(1))",
     ['<a href="https://example.org/a?b=1&amp;c=2" target="_blank" rel="noopener noreferrer">ok</a>', "[bad](javascript:alert(1))"],
     ['href="javascript']),
    ("# Title\n\n- one\n- two\n\n3. three\n4. four\n\n> quoted\n\n---",
     ["<h3>Title</h3>", "<ul><li>one</li><li>two</li></ul>", '<ol start="3"><li>three</li><li>four</li></ol>',
      "<blockquote><p>quoted</p></blockquote>", "<hr>"], []),
]


def test_markdown_renderer(ui, server):
    """The page's own Markdown and highlighting (static/markdown.js), in the browser that runs it."""
    p = ui().open()
    for src, must, must_not in MARKDOWN_CASES:
        html = p.page.evaluate("async (s) => (await import('/static/markdown.js')).renderMarkdown(s)", src)
        for frag in must:
            assert frag in html, (src, frag, html)
        for frag in must_not:
            assert frag not in html, (src, frag, html)


def test_server_restart_mid_reply(browser, tmp_path):
    """A server killed mid-reply: the page says the connection dropped and keeps what arrived; once the server
    is back on the same port, regenerate works."""
    port = free_port()
    log = tmp_path / "server.log"
    proc = start_server(port, log)
    p = Page(browser, f"http://127.0.0.1:{port}")
    try:
        p.open()
        p.settings(temperature=0, max_tokens=2000)
        p.send("Count from 1 to 500, one number per line.")
        content = p.last_reply().locator("[data-testid=content]")
        deadline = time.monotonic() + 30
        while len(content.inner_text()) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        p.wait_done()
        err = p.last_reply().locator("[data-testid=message-error]").inner_text()
        assert "connection dropped before the reply finished" in err, err
        assert content.inner_text().strip()  # what arrived before the drop is kept
        proc = start_server(port, log)
        p.settings(max_tokens=8)
        p.last_reply().locator("[data-testid=regenerate]").click()
        p.wait_done()
        assert p.last_reply().locator("[data-testid=message-error]").count() == 0
        assert p.page.locator(".message").count() == 2
    finally:
        p.close()
        stop_server(proc)
