// The chat view: the conversation list, the messages, the composer, the settings.
// A streamed reply is drawn at most once per animation frame (only that message is re-rendered),
// so a long conversation stays responsive while tokens arrive.

import {APIError, StreamDropped} from "./api.js";
import {escapeHtml, renderMarkdown} from "./markdown.js";

const $ = (id) => document.getElementById(id);
const SETTING_FIELDS = ["temperature", "top_p", "top_k", "max_tokens", "seed"];

export class ChatView {
  constructor(api, store, props, banner) {
    this.api = api;
    this.store = store;
    this.props = props;
    this.banner = banner;
    this.current = null;      // the conversation shown
    this.streaming = null;    // {conv, msg, el, controller, dirty}
    this.settings = {...this.defaults(), ...store.loadSettings()};
    this.api.apiKey = this.settings.api_key || "";
    this.bind();
    this.fillSettings();
    const first = store.conversations[0];
    this.select(first ? first.id : null);
  }

  defaults() {
    const d = (this.props && this.props.defaults) || {};
    return {temperature: d.temperature ?? 1, top_p: d.top_p ?? 1, top_k: d.top_k ?? 0,
            max_tokens: d.max_tokens ?? null, seed: d.seed ?? null};
  }

  // ---------------------------------------------------------------- wiring
  bind() {
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); this.send(); }
      else if (e.key === "Escape" && this.streaming) { e.preventDefault(); this.stop(); }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("new-chat").addEventListener("click", () => { this.select(null); $("prompt").focus(); });
    $("settings-form").addEventListener("input", () => this.readSettings());
    $("reset-settings").addEventListener("click", () => {
      this.settings = {...this.defaults(), system: this.settings.system, api_key: this.settings.api_key};
      this.fillSettings();
      this.store.saveSettings(this.settings);
    });
    $("export-chats").addEventListener("click", () => this.exportAll());
    $("import-chats").addEventListener("change", (e) => this.importFile(e.target));
    $("messages").addEventListener("click", (e) => this.onMessageClick(e));
    $("conversation-list").addEventListener("click", (e) => this.onListClick(e));
    $("conversation-list").addEventListener("keydown", (e) => this.onListKey(e));
  }

  fillSettings() {
    for (const k of SETTING_FIELDS) $(`set-${k}`).value = this.settings[k] ?? "";
    $("set-api_key").value = this.settings.api_key || "";
    $("set-system").value = this.current ? (this.current.system || "") : (this.settings.system || "");
  }

  readSettings() {
    for (const k of SETTING_FIELDS) {
      const v = $(`set-${k}`).value.trim();
      this.settings[k] = v === "" ? null : Number(v);
    }
    this.settings.api_key = $("set-api_key").value.trim();
    this.api.apiKey = this.settings.api_key;
    this.settings.system = $("set-system").value;
    if (this.current && this.current.system !== this.settings.system) {
      this.current.system = this.settings.system;
      this.store.save();
    }
    this.store.saveSettings(this.settings);
  }

  // ---------------------------------------------------------------- conversations
  select(id) {
    this.current = id ? this.store.get(id) : null;
    this.fillSettings();
    this.renderList();
    this.renderMessages();
  }

  renderList() {
    const ul = $("conversation-list");
    ul.innerHTML = this.store.conversations.map((c) => `
      <li data-id="${escapeHtml(c.id)}" class="${this.current && c.id === this.current.id ? "active" : ""}">
        <button type="button" class="conv-title" data-act="open" data-testid="conversation">${escapeHtml(c.title)}</button>
        <button type="button" class="small" data-act="rename" aria-label="Rename" title="Rename">&#9998;</button>
        <button type="button" class="small" data-act="delete" aria-label="Delete" title="Delete">&#10005;</button>
      </li>`).join("");
  }

  onListClick(e) {
    const btn = e.target.closest("button[data-act]");
    if (!btn) return;
    const id = btn.closest("li").dataset.id;
    const act = btn.dataset.act;
    if (act === "open") this.select(id);
    else if (act === "rename") this.startRename(btn.closest("li"), id);
    else if (act === "delete") {
      if (btn.dataset.armed) {
        if (this.streaming && this.streaming.conv.id === id) this.stop();
        this.store.remove(id);
        this.select(this.current && this.current.id === id ? null : this.current && this.current.id);
      } else {  // a second click within 3 s deletes
        btn.dataset.armed = "1";
        btn.textContent = "Delete?";
        setTimeout(() => { if (btn.isConnected) { delete btn.dataset.armed; btn.innerHTML = "&#10005;"; } }, 3000);
      }
    }
  }

  startRename(li, id) {
    const c = this.store.get(id);
    li.innerHTML = `<input class="rename" data-testid="rename-input" aria-label="New title" value="${escapeHtml(c.title)}">`;
    const input = li.querySelector("input");
    input.focus();
    input.select();
    const done = (commit) => {
      if (commit) this.store.rename(id, input.value);
      this.renderList();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") { e.preventDefault(); done(true); }
      if (e.key === "Escape") { e.preventDefault(); done(false); }
    });
    input.addEventListener("blur", () => done(true), {once: true});
  }

  onListKey(e) {
    if (e.key === "Delete" && e.target.dataset.act === "open") e.target.parentElement.querySelector('[data-act="delete"]').click();
  }

  exportAll() {
    const blob = new Blob([this.store.exportJSON()], {type: "application/json"});
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = "turbollm-conversations.json";
    a.click();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  async importFile(input) {
    const file = input.files && input.files[0];
    if (!file) return;
    try {
      const [added, skipped] = this.store.importJSON(await file.text());
      this.banner(`Imported ${added} conversation(s)` + (skipped ? `; ${skipped} malformed one(s) skipped.` : "."), "info");
      this.renderList();
    } catch (e) {
      this.banner(`Import failed: ${e.message}. Nothing was changed.`, "error");
    }
    input.value = "";
  }

  // ---------------------------------------------------------------- messages
  messageHtml(m, i, last) {
    const body = m.role === "assistant" ? renderMarkdown(m.content) : `<p>${escapeHtml(m.content).replace(/\n/g, "<br>")}</p>`;
    const actions = m.role === "user"
      ? `<button type="button" class="small" data-act="edit" data-testid="edit">Edit</button>`
      : (last ? `<button type="button" class="small" data-act="regenerate" data-testid="regenerate">Regenerate</button>` : "");
    return `<div class="message ${m.role}" data-index="${i}" data-testid="message-${m.role}">
      <div class="content" data-testid="content">${body}</div>
      ${m.error ? `<div class="error" role="alert" data-testid="message-error">${escapeHtml(m.error)}</div>` : ""}
      <div class="meta">${this.statsHtml(m)}<span class="actions">${actions}</span></div></div>`;
  }

  statsHtml(m) {
    const s = m.stats;
    if (!s) return "";
    const parts = [];
    if (s.tokens != null) parts.push(`${s.tokens} tokens`);
    if (s.ttft_ms != null) parts.push(`TTFT ${Math.round(s.ttft_ms)} ms`);
    if (s.tps != null) parts.push(`${s.tps.toFixed(1)} tok/s`);
    if (s.prompt_tokens != null) parts.push(`prompt ${s.prompt_tokens}` + (s.cached_tokens != null ? ` (${s.cached_tokens} from cache)` : ""));
    if (m.stopped) parts.push("stopped");
    return `<span class="stats" data-testid="stats">${parts.join(" · ")}</span>`;
  }

  renderMessages() {
    const box = $("messages");
    const msgs = this.current ? this.current.messages : [];
    if (!msgs.length) {
      box.innerHTML = `<p class="empty">Send a message to start${this.props ? ` (model ${escapeHtml(this.props.model)}, context ${this.props.max_model_len} tokens)` : ""}.</p>`;
    } else {
      box.innerHTML = msgs.map((m, i) => this.messageHtml(m, i, i === msgs.length - 1)).join("");
    }
    box.dataset.conv = this.current && msgs.length ? this.current.id : "";
    this.afterRender(box);
  }

  // Redraw the current conversation from message `from` on, and the one before it (its Regenerate button depends
  // on being last), keeping the elements of everything earlier: a send, a reply's end, a regenerate or an edit in
  // a 200-message conversation costs what its tail costs, not a redraw of the whole conversation.
  renderTail(from) {
    const box = $("messages");
    const msgs = this.current ? this.current.messages : [];
    const start = Math.max(0, from - 1);
    const shown = box.querySelectorAll(".message");
    const editing = box.querySelector(".edit-box");  // an edit box left open above the tail closes, as before
    if (!msgs.length || !shown.length || box.dataset.conv !== this.current.id || shown.length < start
        || (editing && +editing.closest(".message").dataset.index < start)) return this.renderMessages();
    for (let k = shown.length - 1; k >= 0 && +shown[k].dataset.index >= start; k--) shown[k].remove();
    box.insertAdjacentHTML("beforeend", msgs.slice(start).map((m, k) => this.messageHtml(m, start + k, start + k === msgs.length - 1)).join(""));
    this.afterRender(box);
  }

  afterRender(box) {
    if (this.streaming && this.current && this.streaming.conv === this.current) {
      this.streaming.el = box.querySelector(`.message[data-index="${this.current.messages.indexOf(this.streaming.msg)}"]`);
    }
    box.scrollTop = box.scrollHeight;
  }

  onMessageClick(e) {
    const copy = e.target.closest(".copy-code");
    if (copy) return this.copyCode(copy);
    const btn = e.target.closest("button[data-act]");
    if (!btn || !this.current) return;
    const i = +btn.closest(".message").dataset.index;
    if (btn.dataset.act === "regenerate") this.regenerate();
    else if (btn.dataset.act === "edit") this.startEdit(btn.closest(".message"), i);
  }

  copyCode(btn) {
    const text = btn.closest(".code-block").querySelector("code").textContent;
    const ok = () => { btn.textContent = "Copied"; setTimeout(() => { btn.textContent = "Copy"; }, 1500); };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(ok, () => this.copyFallback(text, ok));
    } else this.copyFallback(text, ok);
  }

  copyFallback(text, ok) {
    const ta = document.createElement("textarea");
    ta.value = text;
    document.body.appendChild(ta);
    ta.select();
    try { if (document.execCommand("copy")) ok(); } finally { ta.remove(); }
  }

  startEdit(el, i) {
    if (this.streaming) return;
    const m = this.current.messages[i];
    el.querySelector(".content").innerHTML =
      `<textarea class="edit-box" data-testid="edit-box" rows="3" aria-label="Edit message">${escapeHtml(m.content)}</textarea>
       <div class="edit-actions"><button type="button" data-testid="edit-send">Send</button>
       <button type="button" class="secondary" data-testid="edit-cancel">Cancel</button></div>`;
    const box = el.querySelector("textarea");
    box.focus();
    const commit = () => {
      const text = box.value.trim();
      if (!text) return;
      m.content = text;
      this.current.messages.length = i + 1;  // what followed the edited message is replaced
      this.store.save();
      this.renderTail(i);
      this.generate(this.current);
    };
    el.querySelector('[data-testid="edit-send"]').addEventListener("click", commit);
    el.querySelector('[data-testid="edit-cancel"]').addEventListener("click", () => this.renderTail(i));
    box.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); commit(); }
      if (e.key === "Escape") { e.preventDefault(); this.renderTail(i); }
    });
  }

  // ---------------------------------------------------------------- requests
  send() {
    const box = $("prompt");
    const text = box.value.trim();
    if (!text || this.streaming) return;
    let c = this.current;
    if (!c) {
      c = this.store.create(this.settings.system || "");
      this.current = c;
    }
    if (!c.messages.length) c.title = text.replace(/\s+/g, " ").slice(0, 60);
    c.messages.push({role: "user", content: text});
    box.value = "";
    this.store.save();
    this.renderList();
    this.renderTail(c.messages.length - 1);
    this.generate(c);
  }

  regenerate() {
    const c = this.current;
    if (this.streaming || !c || !c.messages.length) return;
    if (c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
    if (!c.messages.length) return;
    this.store.save();
    this.renderTail(c.messages.length);
    this.generate(c);
  }

  stop() {
    if (this.streaming) this.streaming.controller.abort();
  }

  requestBody(c) {
    const messages = [];
    if (c.system && c.system.trim()) messages.push({role: "system", content: c.system});
    for (const m of c.messages) {
      if (m.role === "assistant" && !m.content) continue;  // a reply that failed before its first token
      messages.push({role: m.role, content: m.content});
    }
    const body = {model: this.props ? this.props.model : undefined, messages, stream: true,
                  stream_options: {include_usage: true}};
    for (const k of SETTING_FIELDS) if (this.settings[k] !== null && this.settings[k] !== undefined && !Number.isNaN(this.settings[k])) body[k] = this.settings[k];
    return body;
  }

  async generate(c) {
    const msg = {role: "assistant", content: ""};
    const body = this.requestBody(c);
    c.messages.push(msg);
    this.renderTail(c.messages.length - 1);
    const controller = new AbortController();
    const st = {conv: c, msg, controller, el: null, dirty: false, frame: 0, lastSave: performance.now()};
    this.streaming = st;
    st.el = $("messages").querySelector(`.message[data-index="${c.messages.length - 1}"]`);
    this.setBusy(true);
    const t0 = performance.now();
    let tFirst = null, pieces = 0;
    try {
      const {finishReason, usage} = await this.api.streamChat(body, controller.signal, (text) => {
        if (tFirst === null) tFirst = performance.now();
        pieces++;
        msg.content += text;
        this.scheduleDraw(st);
      });
      msg.finish_reason = finishReason;
      const tEnd = performance.now();
      const tokens = usage ? usage.completion_tokens : pieces;
      msg.stats = {tokens, ttft_ms: tFirst === null ? null : tFirst - t0,
                   tps: tFirst !== null && tokens > 1 && tEnd > tFirst ? (tokens - 1) * 1000 / (tEnd - tFirst) : null,
                   prompt_tokens: usage ? usage.prompt_tokens : null,
                   cached_tokens: usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null};
    } catch (e) {
      msg.stats = {tokens: pieces, ttft_ms: tFirst === null ? null : tFirst - t0};
      if (e.name === "AbortError") msg.stopped = true;
      else if (e instanceof StreamDropped) msg.error = `${e.message}; ${pieces} piece(s) kept. Regenerate to try again.`;
      else if (e instanceof APIError) msg.error = e.message;
      else msg.error = `Unexpected error: ${e.message}`;
    } finally {
      cancelAnimationFrame(st.frame);
      this.streaming = null;
      this.setBusy(false);
      this.store.save();
      if (this.current === c) this.renderTail(c.messages.indexOf(msg));
      this.showStoreProblems();
    }
  }

  scheduleDraw(st) {
    if (st.dirty) return;
    st.dirty = true;
    st.frame = requestAnimationFrame(() => {
      st.dirty = false;
      if (this.current !== st.conv || !st.el) return;
      const box = $("messages");
      const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
      st.el.querySelector(".content").innerHTML = renderMarkdown(st.msg.content);
      if (atBottom) box.scrollTop = box.scrollHeight;
      const now = performance.now();
      if (now - st.lastSave > 2000) { st.lastSave = now; this.store.save(); }
    });
  }

  setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    document.body.classList.toggle("busy", busy);
    if (!busy && document.activeElement === $("stop")) $("prompt").focus();
  }

  showStoreProblems() {
    if (this.store.problems.length) this.banner(this.store.problems.splice(0).join(" "), "error");
  }
}
