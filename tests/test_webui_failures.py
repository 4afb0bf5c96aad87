"""What goes wrong, in a real browser (the harness: tests/webui_harness.py): a 401, a prompt over the context, a 503
with Retry-After, a stream that ends early, a server killed mid-reply (then back on its port) and corrupt stored
data are shown as what they are and the conversation stays usable; the page's own Markdown renderer escapes what a
reply holds; and `test_stream_check_can_fail` serves the page with its stream handler removed and sees the
streaming check of test_webui_browser.py fail.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from conftest import free_port
from webui_harness import CONV_KEY, KEY, MAX_LEN, WATCH, Page, start_server, stop_server

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_errors_are_shown_and_the_conversation_stays_usable(ui, webui_server):
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


def test_server_restart_mid_reply(chromium, tmp_path):
    """A server killed mid-reply: the page says the connection dropped and keeps what arrived; once the server
    is back on the same port, regenerate works."""
    port = free_port()
    log = tmp_path / "server.log"
    proc = start_server(port, log)
    p = Page(chromium, f"http://127.0.0.1:{port}")
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
def test_stream_check_can_fail(ui, webui_server):
    """The same page with its stream handler removed: the streaming check above must fail on it."""
    p = ui()
    api_js = httpx.get(webui_server["base"] + "/static/api.js").text
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


def test_markdown_renderer(ui, webui_server):
    """The page's own Markdown and highlighting (static/markdown.js), in the browser that runs it."""
    p = ui().open()
    for src, must, must_not in MARKDOWN_CASES:
        html = p.page.evaluate("async (s) => (await import('/static/markdown.js')).renderMarkdown(s)", src)
        for frag in must:
            assert frag in html, (src, frag, html)
        for frag in must_not:
            assert frag not in html, (src, frag, html)
