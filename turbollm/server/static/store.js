// Conversations and settings in the browser's localStorage.
// A stored value that cannot be read is never thrown away: it is copied under a ".corrupt-<time>" key
// and the page says so; conversations that are individually malformed are set aside the same way.

export const KEY = "turbollm.conversations.v1";
export const SETTINGS_KEY = "turbollm.settings.v1";
const ROLES = new Set(["user", "assistant"]);

function validMessage(m) {
  return m && typeof m === "object" && ROLES.has(m.role) && typeof m.content === "string";
}

export function validConversation(c) {
  return c && typeof c === "object" && typeof c.id === "string" && typeof c.title === "string" &&
         Array.isArray(c.messages) && c.messages.every(validMessage) &&
         (c.system === undefined || typeof c.system === "string");
}

export function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

export class Store {
  constructor(storage) {
    this.storage = storage;
    this.conversations = [];
    this.problems = [];  // messages for the page: what could not be read or saved
    this.load();
  }

  setAside(raw, why) {
    const key = `${KEY}.corrupt-${Date.now()}`;
    try {
      this.storage.setItem(key, raw);
      this.problems.push(`${why}; the data is kept in this browser's localStorage under "${key}".`);
    } catch (e) {
      this.problems.push(`${why}; it could not be copied aside either (${e.message}) and was left where it was.`);
      return false;
    }
    return true;
  }

  load() {
    const raw = this.storage.getItem(KEY);
    if (raw === null) return;
    let data;
    try {
      data = JSON.parse(raw);
      if (!data || data.version !== 1 || !Array.isArray(data.conversations)) throw new Error("not a version-1 conversation list");
    } catch (e) {
      if (this.setAside(raw, `Stored conversations could not be read (${e.message})`)) this.storage.removeItem(KEY);
      return;
    }
    const bad = data.conversations.filter((c) => !validConversation(c));
    this.conversations = data.conversations.filter(validConversation);
    if (bad.length) this.setAside(JSON.stringify({version: 1, conversations: bad}),
                                  `${bad.length} stored conversation(s) were malformed and set aside`);
  }

  save() {
    try {
      this.storage.setItem(KEY, JSON.stringify({version: 1, conversations: this.conversations}));
      return true;
    } catch (e) {
      this.problems.push(`Conversations could not be saved in the browser (${e.message}).`);
      return false;
    }
  }

  create(system = "") {
    const c = {id: newId(), title: "New conversation", created: Date.now(), system, messages: []};
    this.conversations.unshift(c);
    return c;
  }

  get(id) { return this.conversations.find((c) => c.id === id) || null; }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    this.save();
  }

  rename(id, title) {
    const c = this.get(id);
    if (c && title.trim()) { c.title = title.trim().slice(0, 200); this.save(); }
  }

  exportJSON() {
    return JSON.stringify({version: 1, exported: new Date().toISOString(), conversations: this.conversations}, null, 1);
  }

  // Adds the valid conversations of an export (new ids where they clash); returns [added, skipped].
  importJSON(text) {
    const data = JSON.parse(text);
    const list = Array.isArray(data) ? data : data && data.conversations;
    if (!Array.isArray(list)) throw new Error("the file holds no conversation list");
    let added = 0, skipped = 0;
    for (const c of list) {
      if (!validConversation(c)) { skipped++; continue; }
      if (this.get(c.id)) c.id = newId();
      this.conversations.unshift(c);
      added++;
    }
    this.save();
    return [added, skipped];
  }

  loadSettings() {
    try {
      const s = JSON.parse(this.storage.getItem(SETTINGS_KEY) || "{}");
      return s && typeof s === "object" && !Array.isArray(s) ? s : {};
    } catch (e) {
      this.problems.push(`Saved settings could not be read (${e.message}); the server's defaults are used.`);
      return {};
    }
  }

  saveSettings(s) {
    try { this.storage.setItem(SETTINGS_KEY, JSON.stringify(s)); } catch (e) { /* settings stay for this visit */ }
  }
}
