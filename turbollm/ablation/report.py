"""The ablation's outputs (ablation/study.py): a Markdown section, a waterfall PNG, and the section put in
place in a Markdown file between markers of its own, so the command regenerates docs/ABLATION.md one model at
a time."""

from __future__ import annotations

import re

from turbollm.ablation.study import AblationReport


def _f(v, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def _ms(s: dict | None, a: str, b: str) -> str:
    if not s:
        return "–"
    return f"{_f(s[a]['median'], '{:.0f}')} / {_f(s[b]['median'], '{:.0f}')}"


def _row(rep: AblationReport, c, f: dict | None) -> str:
    """One configuration's line; `f` the factor shown in the third column (None: the baseline)."""
    s = rep.summary(c)
    if c.skipped or not s:
        return f"| {c.name} | skipped: {c.skipped} |" + " |" * 9
    tok = s["out_tok_s"]
    fac = "1.00" if f is None else f"{f['median']:.2f} ({f['min']:.2f}–{f['max']:.2f})"
    dp = rep.ppl_change(c)
    return (f"| {c.name} | {tok['median']:.1f} ({tok['min']:.1f}–{tok['max']:.1f}) | {fac} | "
            f"{_f(s['per_user_tok_s']['median'])} | {_ms(s, 'ttft_p50_ms', 'ttft_p99_ms')} | "
            f"{_ms(s, 'itl_p50_ms', 'itl_p99_ms')} | {s['peak_gib']['median']:.2f} | {s['kv_tokens']['median']:.0f} "
            f"({s['most_running']['max']:.0f}) | {_f(None if dp is None else round(100 * dp, 2) or 0.0, '{:+.2f}%')} | "
            f"{s['agreement']['median']:.2f} |")


HEAD = ("| configuration | out tok/s, median (min–max) | {} | tok/s per user | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| peak GiB | KV tokens (most running) | Δppl | greedy agreement |\n|---|---|---|---|---|---|---|---|---|---|")


def markdown(rep: AblationReport, command: str) -> str:
    st = rep.setting
    steps = [c for c in rep.configs if c.kind in ("baseline", "step")]
    ran = [c for c in steps if not c.skipped]
    full = ran[-1]
    sp = rep.factor(ran[0], full)
    lines = [
        f"### {rep.model}", "",
        f"`{command}` — {st['date']}, {st['cpu']}, {st['cores']} cores. {st['requests']} requests at once, each a "
        f"{st['system_prompt_tokens']}-token system prompt + a ShareGPT prompt ({st['prompt_tokens_mean']} tokens "
        f"on average in all), {st['new_tokens']} new tokens each (greedy, EOS ignored); K/V memory "
        f"{st['kv_cache_memory_mib']} MiB for every configuration ({st['kv_budget_note']}); "
        f"{st['repeats']} repeats, interleaved. Speculation: {st['spec']}. Parallel step: {st['parallel']}. "
        f"Δppl: WikiText-2, first {st['ppl']['tokens']} tokens, windows of {st['ppl']['ctx']}, against the "
        "baseline's float32 weights and K/V. Greedy agreement: the share of the baseline's tokens each request "
        "repeats before it first differs. TTFT counts from the moment the whole batch arrives.", "",
        f"**Whole stack over the baseline: {sp['median']:.2f}×** out tok/s (repeats allow {sp['min']:.2f}–"
        f"{sp['max']:.2f}×).", "",
        "Each technique added to the one before:", "", HEAD.format("× the row above (range)")]
    prev = None
    for c in steps:
        lines.append(_row(rep, c, None if prev is None or c.skipped else rep.factor(prev, c)))
        if not c.skipped:
            prev = c
    lines += ["", "The full stack less one technique (× = the full stack over this row: what the technique buys "
              "with everything else on):", "", HEAD.format("full stack × (range)")]
    for c in rep.configs:
        if c.kind == "leave-one-out":
            lines.append(_row(rep, c, None if c.skipped else rep.factor(c, full)))
    q = ", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in rep.quality.items())
    lines += ["", f"Perplexities (weights/K/V): {q}.", ""]
    return "\n".join(lines)


def plot_waterfall(rep: AblationReport, path: str) -> None:
    """Cumulative speedup over the baseline as each technique is added (log scale; whiskers: the repeats'
    range of each step), and beside it what leaving each one out of the full stack costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [c for c in rep.configs if c.kind in ("baseline", "step") and not c.skipped]
    loo = [c for c in rep.configs if c.kind == "leave-one-out" and not c.skipped]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    cum, x = 1.0, list(range(len(steps)))
    for i, c in enumerate(steps):
        if i == 0:
            ax.bar(i, 1.0 - 0.85, bottom=0.85, color="0.6")  # the baseline: 1 (a log axis has no 0)
            continue
        f = rep.factor(steps[i - 1], c)
        new = cum * f["median"]
        lo, hi = sorted((cum, new))
        ax.bar(i, hi - lo, bottom=lo, color="tab:green" if new >= cum else "tab:red")
        ax.errorbar(i, new, yerr=[[new - cum * f["min"]], [cum * f["max"] - new]], color="k", capsize=3)
        ax.annotate(f"×{f['median']:.2f}", (i, max(hi, cum * f["max"])), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
        cum = new
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.85)
    times = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}×")
    ax.yaxis.set_major_formatter(times)
    ax.yaxis.set_minor_formatter(times)
    ax.set_xticks(x, [c.name for c in steps], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("out tokens/s over the baseline")
    ax.set_title(f"{rep.model}: techniques added in order (stack ×{cum:.2f})")
    if loo:
        fs = [rep.factor(c, steps[-1]) for c in loo]
        bx.barh(range(len(loo)), [f["median"] for f in fs],
                xerr=[[f["median"] - f["min"] for f in fs], [f["max"] - f["median"] for f in fs]],
                color=["tab:green" if f["median"] >= 1 else "tab:red" for f in fs], capsize=3)
        bx.axvline(1.0, color="k", lw=0.8)
        bx.set_yticks(range(len(loo)), [c.name for c in loo], fontsize=8)
        bx.set_xlabel("full stack / full stack without it")
        bx.set_title("leave-one-out")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_section(text: str, model: str, section: str) -> str:
    """`text` with the section of `model` (between its markers) replaced by `section`, or appended."""
    start, end = f"<!-- ablation:{model} -->", f"<!-- /ablation:{model} -->"
    block = f"{start}\n{section.rstrip()}\n{end}"
    pat = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if pat.search(text):
        return pat.sub(lambda _: block, text)
    return text.rstrip() + "\n\n" + block + "\n"


def compare(previous: dict, current: dict, tolerance: float = 0.15) -> tuple[str, bool]:
    """A rerun against an earlier run's JSON (`--compare`): each configuration's median out tok/s, the stacked
    speedup and each step's factor, now over then; True when every ratio is within ±`tolerance`."""
    def medians(d: dict) -> dict:
        return {c["name"]: c["summary"]["out_tok_s"]["median"] for c in d["configs"] if c.get("summary")}

    then, now = medians(previous), medians(current)
    rows, ok = [], True
    for name in [n for n in now if n in then]:
        rows.append((name, then[name], now[name]))
    rows.append(("stacked speedup", previous["stacked_speedup"]["median"], current["stacked_speedup"]["median"]))
    prev_steps = {s["name"]: s["median"] for s in previous["step_factors"]}
    for s in current["step_factors"]:
        if s["name"] in prev_steps:
            rows.append((f"step factor {s['name']}", prev_steps[s["name"]], s["median"]))
    lines = ["| | earlier run | this run | this / earlier |", "|---|---|---|---|"]
    for name, a, b in rows:
        r = b / a if a else float("inf")
        within = abs(r - 1) <= tolerance
        ok &= within
        note = "" if within else f" (outside ±{round(100 * tolerance)}%)"
        lines.append(f"| {name} | {a:.2f} | {b:.2f} | {r:.2f}{note} |")
    return "\n".join(lines), ok
