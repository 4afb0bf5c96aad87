// The dashboard view: GET /stats every second while the view is shown; tiles, line charts, tables.

import {escapeHtml} from "./markdown.js";

const $ = (id) => document.getElementById(id);
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];

function fmtBytes(b) {
  if (b == null) return "–";
  const u = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return `${b.toFixed(i ? 1 : 0)} ${u[i]}`;
}
const pct = (x) => (x == null ? "–" : `${(100 * x).toFixed(1)}%`);
const num = (x, d = 1) => (x == null ? "–" : Number(x).toFixed(d));

// A line chart on a canvas: series of [t, y] points over the last `span` seconds.
class LineChart {
  constructor(parent, title, names, {unit = "", percent = false} = {}) {
    const fig = document.createElement("figure");
    fig.className = "chart";
    fig.innerHTML = `<figcaption>${escapeHtml(title)}</figcaption><canvas height="140"></canvas><div class="legend"></div>`;
    parent.appendChild(fig);
    this.canvas = fig.querySelector("canvas");
    this.legend = fig.querySelector(".legend");
    this.names = names;
    this.unit = unit;
    this.percent = percent;
    this.fig = fig;
  }

  draw(samples, pick, span) {
    const c = this.canvas;
    const w = c.clientWidth || 300;
    const dpr = window.devicePixelRatio || 1;
    if (c.width !== Math.round(w * dpr)) c.width = Math.round(w * dpr);
    c.height = Math.round(140 * dpr);
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, 140);
    const series = this.names.map((_, k) => samples.map((s) => [s.t, pick(s, k)]).filter((p) => p[1] != null && isFinite(p[1])));
    const tMax = samples.length ? samples[samples.length - 1].t : 0;
    const tMin = tMax - span;
    let yMax = this.percent ? 1 : 0;
    for (const s of series) for (const p of s) yMax = Math.max(yMax, p[1]);
    if (yMax <= 0) yMax = 1;
    yMax *= this.percent ? 1 : 1.1;
    const left = 40, bottom = 125, top = 8, right = w - 6;
    g.strokeStyle = "#d4d4d8";
    g.fillStyle = "#71717a";
    g.font = "10px sans-serif";
    g.lineWidth = 1;
    g.beginPath();
    g.moveTo(left, top); g.lineTo(left, bottom); g.lineTo(right, bottom);
    g.stroke();
    g.fillText(this.percent ? "100%" : num(yMax, yMax < 10 ? 1 : 0), 2, top + 8);
    g.fillText("0", 2, bottom);
    g.fillText(`-${Math.round(span / 60)} min`, left, 138);
    g.fillText("now", right - 20, 138);
    series.forEach((s, k) => {
      g.strokeStyle = COLORS[k % COLORS.length];
      g.lineWidth = 1.5;
      g.beginPath();
      s.forEach(([t, y], i) => {
        const x = left + (right - left) * (t - tMin) / span;
        const yy = bottom - (bottom - top) * y / yMax;
        if (i) g.lineTo(x, yy); else g.moveTo(x, yy);
      });
      g.stroke();
    });
    this.legend.innerHTML = this.names.map((n, k) => {
      const s = series[k];
      const last = s.length ? s[s.length - 1][1] : null;
      const v = this.percent ? pct(last) : `${num(last, 2)}${this.unit}`;
      return `<span><i class="swatch c${k % COLORS.length}"></i>${escapeHtml(n)}: <b data-testid="legend-value">${v}</b></span>`;
    }).join("");
  }
}

export class DashboardView {
  constructor(api, banner) {
    this.api = api;
    this.banner = banner;
    this.samples = [];
    this.timer = null;
    this.since = null;
    this.window = 300;
    this.failures = 0;
    const p = $("charts");
    this.charts = {
      requests: new LineChart(p, "Requests", ["running", "waiting"]),
      batch: new LineChart(p, "Batch: sequences per step", ["sequences"]),
      tokens: new LineChart(p, "Tokens per step (prefill chunks and decodes)", ["tokens"]),
      tps: new LineChart(p, "Generation", ["tokens/s"]),
      kv: new LineChart(p, "KV blocks used, by group", ["group 0"]),
      prefix: new LineChart(p, "Prefix-cache hit rate (per interval)", ["hit rate"], {percent: true}),
      spec: new LineChart(p, "Speculative decoding", ["acceptance rate", "mean accepted length"]),
    };
  }

  start() {
    if (this.timer) return;
    this.poll();
    this.timer = setInterval(() => this.poll(), 1000);
    this.onResize = () => this.draw();
    window.addEventListener("resize", this.onResize);
  }

  stop() {
    clearInterval(this.timer);
    this.timer = null;
    window.removeEventListener("resize", this.onResize);
  }

  async poll() {
    if (this.busy || document.hidden) return;  // a hidden tab catches up from `since` when shown again
    this.busy = true;
    try {
      const q = this.since == null ? "" : `?since=${this.since}`;
      const d = await this.api.json(`/stats${q}`);
      this.failures = 0;
      this.window = d.window_s;
      for (const s of d.samples) this.samples.push(s);
      if (d.samples.length) this.since = d.samples[d.samples.length - 1].t;
      const cut = d.time - d.window_s;
      while (this.samples.length && this.samples[0].t < cut) this.samples.shift();
      this.latest = d;
      this.draw();
      $("view-dashboard").dataset.updated = String(d.time);
    } catch (e) {
      if (++this.failures === 3) this.banner(`The dashboard cannot read /stats (${e.message}); it keeps trying.`, "error");
    } finally {
      this.busy = false;
    }
  }

  draw() {
    const d = this.latest;
    if (!d) return;
    const t = d.totals, span = this.window, S = this.samples;
    const last = S.length ? S[S.length - 1] : {};
    const tiles = [
      ["Running", t.running, "running"], ["Waiting", t.waiting, "waiting"],
      ["Tokens generated", t.generation_tokens, "generation-tokens"], ["Requests finished", t.requests_finished, "requests-finished"],
      ["Generation tok/s", num(last.generation_tps), "tps"], ["Batch (seqs/step)", num(last.batch_size, 2), "batch"],
      ["Tokens per step", num(last.tokens_per_step, 1), "tokens-per-step"],
      ["KV usage", `${pct(t.kv_usage)} (${t.kv_blocks_used}/${t.kv_blocks_total} blocks)`, "kv-usage"],
      ["KV bytes", Object.entries(t.kv_bytes_by_dtype).map(([k, v]) => `${fmtBytes(v)} ${k}`).join(", ") || "0", "kv-bytes"],
      ["Prefix-cache hit rate", `${pct(t.prefix_hit_rate)} of ${t.prefix_cache_queries} tokens`, "prefix-hit"],
      ["Speculation", t.speculative ? `${pct(t.spec_acceptance_rate)} accepted, ${num(t.spec_mean_accepted_length, 2)} tokens/step` : "off", "spec"],
      ["Preemptions", t.num_preemptions, "preemptions"], ["Steps", t.steps, "steps"],
    ];
    $("tiles").innerHTML = tiles.map(([k, v, id]) =>
      `<div class="tile"><span>${escapeHtml(k)}</span><b data-testid="tile-${id}">${escapeHtml(String(v))}</b></div>`).join("");
    this.charts.requests.draw(S, (s, k) => (k ? s.waiting : s.running), span);
    this.charts.batch.draw(S, (s) => s.batch_size, span);
    this.charts.tokens.draw(S, (s) => s.tokens_per_step, span);
    this.charts.tps.draw(S, (s) => s.generation_tps, span);
    const groups = t.kv_groups.filter((g) => g.kind !== "recent");
    if (this.charts.kv.names.length !== groups.length) this.charts.kv.names = groups.map((g) => `group ${g.group} (${g.kind})`);
    this.charts.kv.draw(S, (s, k) => s.kv_blocks_used[k], span);
    this.charts.prefix.draw(S, (s) => s.prefix_hit_rate, span);
    this.charts.spec.fig.hidden = !t.speculative;
    if (t.speculative) this.charts.spec.draw(S, (s, k) => (k ? s.spec_mean_accepted_length : s.spec_acceptance_rate), span);
    $("window-min").textContent = String(Math.round(span / 60));
    const row = (name, l) => `<tr><th>${name}</th><td>${l.count}</td><td>${num(l.mean_ms)} ms</td><td>${num(l.p50_ms)} ms</td>` +
                             `<td>${num(l.p90_ms)} ms</td><td>${num(l.p99_ms)} ms</td></tr>`;
    $("latency-table").tBodies[0].innerHTML = row("TTFT", d.latency.ttft) + row("ITL", d.latency.itl);
    $("kv-table").tBodies[0].innerHTML = t.kv_groups.map((g) =>
      `<tr><td>${g.group}</td><td>${escapeHtml(g.kind)}</td><td>${g.layers}</td><td>${g.kind === "recent" ? "–" : `${g.blocks_used} / ${g.blocks_total}`}</td>` +
      `<td>${fmtBytes(g.bytes_used)}</td><td>${escapeHtml(g.dtype)}</td></tr>`).join("");
  }
}
