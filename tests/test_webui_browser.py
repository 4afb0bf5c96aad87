"""The chat page and the dashboard in a real browser (the harness: tests/webui_harness.py).

Checked: the page loads all its files and nothing else (their bytes are printed); tokens stream onto the screen,
and the first one is on screen within 100 ms of the API's own TTFT (median of 3: the time from the key press
to the token on screen, less the page's request's own time from fetch to its first content byte); stop aborts
the request on the server; regenerate and edit-and-resend; settings reach the request and survive a reload;
conversations survive a reload, are renamed, deleted, exported and imported; a 200-message conversation keeps
every frame under 100 ms while a reply streams, and the send redraws only the conversation's tail; the dashboard's
counters move without a reload; a narrow window.
What goes wrong, and that these checks can fail: test_webui_failures.py.
"""

from __future__ import annotations

import json
import re
import statistics
import time

import httpx
import pytest

from webui_harness import CONV_KEY, KEY, WATCH, aborted, api_ttft, expect, stats

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_page_loads_from_the_server_alone(ui, webui_server):
    props = httpx.get(webui_server["base"] + "/props").json()
    p = ui()
    sizes: dict[str, int] = {}
    p.page.on("response", lambda r: sizes.__setitem__(r.url, len(r.body())) if r.url.startswith(webui_server["base"] + "/static")
              or r.url == webui_server["base"] + "/" else None)
    p.open()
    assert p.tid("model-name").inner_text().startswith("smollm2-135m")
    p.page.wait_for_timeout(300)
    print(f"\nthe page at /: {sum(sizes.values())} bytes in {len(sizes)} files; /props says {props['webui_bytes']}")
    assert sum(sizes.values()) == props["webui_bytes"] and len(sizes) >= 5  # every file it ships, nothing else
    assert props["api_key_required"] is True


def test_stream_ttft_regenerate_edit_and_reload(ui, webui_server):
    p = ui().open()
    p.settings(temperature=0, max_tokens=8)
    page_ttft, added, ref_ttft = [], [], []
    for i, name in enumerate(["Ann", "Bob", "Cid"]):
        p.tid("new-chat").click()
        p.page.evaluate(WATCH)
        p.send(f"Say hello to {name}, who is {20 + i} years old.")
        p.wait_done()
        t = p.page.evaluate("window.__t")
        assert all(t.get(k) is not None for k in ("sent", "fetch", "recv", "first")), f"no token reached the screen: {t}"
        assert t["sent"] <= t["fetch"] < t["recv"], t
        page_ttft.append((t["first"] - t["sent"]) / 1e3)
        added.append((t["first"] - t["sent"] - (t["recv"] - t["fetch"])) / 1e3)  # the page's share of its TTFT
        ref_ttft.append(api_ttft(webui_server, f"Say hello to {name}x, who is {30 + i} years old."))
    on_screen, page_part, api = (statistics.median(x) for x in (page_ttft, added, ref_ttft))
    print(f"\ntyping to first token on screen: median {1e3 * on_screen:.0f} ms, of which the page "
          f"{1e3 * page_part:.0f} ms (the rest its request's own TTFT); API TTFT: median {1e3 * api:.0f} ms")
    # within 100 ms of the API's TTFT, measured on the page's own request: the engine's TTFT moves more than
    # that between requests on a busy machine (median 402 ms on screen against 282 ms by the API once in CI)
    assert page_part <= 0.100, (added, page_ttft, ref_ttft)

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


def test_settings_reach_the_request(ui, webui_server):
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
    props = httpx.get(webui_server["base"] + "/props").json()["defaults"]
    assert float(p.tid("set-temperature").input_value()) == props["temperature"]
    assert p.tid("set-max_tokens").input_value() == ""


def test_stop_aborts_on_the_server(ui, webui_server):
    p = ui().open()
    p.settings(temperature=0, max_tokens=2000)
    before = aborted(webui_server)
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
    while (stats(webui_server)["totals"]["running"] or aborted(webui_server) == before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats(webui_server)["totals"]["running"] == 0 and aborted(webui_server) == before + 1
    kept = p.last_reply().locator("[data-testid=content]").inner_text()
    assert kept.strip()
    p.page.reload()
    p.page.locator("body[data-ready='1']").wait_for()
    assert p.last_reply().locator("[data-testid=content]").inner_text() == kept  # the partial reply is kept


def test_conversations_rename_delete_export_import(ui, webui_server, tmp_path):
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


def test_long_conversation_stays_responsive(ui, webui_server):
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
      const m = window.__redrawn = {added: 0, removed: 0};  // message elements the send, the stream and its end redraw
      const count = (nodes) => [...nodes].filter((n) => n.classList && n.classList.contains('message')).length;
      new MutationObserver((rs) => { for (const r of rs) { m.added += count(r.addedNodes); m.removed += count(r.removedNodes); } })
        .observe(document.getElementById('messages'), {childList: true});
    }""")
    p.send("Write one more note about the fox.")
    p.wait_done(timeout=120)
    f = p.page.evaluate("window.__frames.on = false, window.__frames")
    redrawn = p.page.evaluate("window.__redrawn")
    toks = p.last_reply().locator("[data-testid=stats]").inner_text()
    print(f"\n200-message conversation, streaming ({toks}): {f['n']} frames, longest {f['max']:.0f} ms, "
          f"longest task {f['long']:.0f} ms; message elements redrawn {redrawn}")
    # the page's own work does not grow with the conversation: the send, the reply and its end redraw the tail
    # (the last message before the new ones, the question, the reply), never the 200 messages above it
    assert redrawn["added"] <= 8, redrawn
    assert p.last_reply().locator("[data-testid=message-error]").count() == 0, \
        p.last_reply().locator("[data-testid=message-error]").inner_text()
    assert p.page.locator(".message").count() == 202 and f["n"] > 30
    assert f["max"] <= 100 and f["long"] <= 100, f


def test_dashboard_counters_move(ui, webui_server):
    p = ui().open("/dashboard")
    assert p.page.locator("#view-dashboard").is_visible() and not p.page.locator("#view-chat").is_visible()
    tile = p.tid("tile-generation-tokens")
    tile.wait_for()
    before = int(tile.inner_text())
    n_loads = p.page.evaluate("performance.getEntriesByType('navigation').length")
    r = httpx.post(webui_server["base"] + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
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


def test_narrow_window(ui, webui_server):
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
