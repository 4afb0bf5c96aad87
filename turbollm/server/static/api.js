// The page's calls to the server: /props, /stats, and a streamed /v1/chat/completions.

export class APIError extends Error {
  constructor(message, status = 0, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export class StreamDropped extends Error {}

export class API {
  constructor(base = "") {
    this.base = base;
    this.apiKey = "";
  }

  headers() {
    const h = {"Content-Type": "application/json"};
    if (this.apiKey) h.Authorization = `Bearer ${this.apiKey}`;
    return h;
  }

  async json(path) {
    const r = await fetch(this.base + path, {headers: this.headers(), cache: "no-store"});
    if (!r.ok) throw await errorOf(r);
    return r.json();
  }

  // POST /v1/chat/completions with stream: true. onDelta(text) per content piece; returns
  // {finishReason, usage}. Throws APIError (the server refused, or reported an error in the stream),
  // StreamDropped (the stream ended before "[DONE]") or the fetch's AbortError (stopped).
  async streamChat(body, signal, onDelta) {
    let r;
    try {
      r = await fetch(this.base + "/v1/chat/completions", {method: "POST", headers: this.headers(),
                                                          body: JSON.stringify(body), signal});
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new APIError(`could not reach the server (${e.message})`);
    }
    if (!r.ok) throw await errorOf(r);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "", finishReason = null, usage = null, done = false;
    try {
      for (;;) {  // after "[DONE]", on to the end of the body (the server closes it)
        const {value, done: end} = await reader.read();
        if (end) break;
        if (done) continue;
        buf += decoder.decode(value, {stream: true});
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data:")) continue;
            const data = line.slice(5).trim();
            if (data === "[DONE]") { done = true; break; }
            const chunk = JSON.parse(data);
            if (chunk.error) throw new APIError(`the server stopped the reply: ${chunk.error.message || chunk.error.type}`,
                                                0, chunk.error.code || null);
            if (chunk.usage) usage = chunk.usage;
            for (const c of chunk.choices || []) {
              if (c.delta && c.delta.content) onDelta(c.delta.content);
              if (c.finish_reason) finishReason = c.finish_reason;
            }
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError" || e instanceof APIError) throw e;
      throw new StreamDropped(`the connection dropped before the reply finished (${e.message})`);
    } finally {
      if (!done) reader.cancel().catch(() => {});
    }
    if (!done) throw new StreamDropped("the connection closed before the reply finished");
    return {finishReason, usage};
  }
}

async function errorOf(r) {
  let message = `${r.status} ${r.statusText}`, code = null;
  try {
    const body = await r.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    } else if (body && body.detail) {
      message = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    }
  } catch (e) { /* not JSON: the status line says it */ }
  if (r.status === 401) message += " — enter the server's API key under Settings";
  if (code === "context_length_exceeded") message += " — edit a message to shorten it, or start a new conversation";
  if (r.status === 503) {
    const after = r.headers.get("Retry-After");
    message += after ? ` — the server asks to retry after ${after} s` : " — retry later";
  }
  return new APIError(`${r.status}: ${message}`, r.status, code);
}
