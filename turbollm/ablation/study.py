"""`turbollm bench ablation MODEL`: what each technique buys, measured on one workload in one run.

The baseline is what a plain PyTorch implementation does: float32 weights (a GGUF's blocks dequantized), the
PyTorch modules for every step with PyTorch attention, float32 K/V, one request at a time, no prefix cache.
Then the techniques are added one by one in the seed's order (`ablation_steps`), and from the full stack
each technique is taken out again (leave-one-out). Every configuration runs in a process of its own
(ablation/run_one.py) on the same requests — a shared system prompt before each ShareGPT prompt,
all arriving at once, greedy, a fixed number of new tokens — and the K/V memory is the same for all, sized
so that float32 K/V holds a quarter of the batch at once (the memory a quantized K/V saves becomes
concurrency). The repeats are interleaved (every configuration once, then again), so drift spreads over all.
Quality: WikiText-2 perplexity of each weight format x K/V dtype against the baseline's, and how much of
each request's greedy output equals the baseline's.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from turbollm.errors import BenchmarkError, InvalidRequestError

# A system prompt written for this benchmark: every request starts with it (the prefix cache's case).
SYSTEM_PROMPT = (
    "You are a careful and friendly assistant working for a small software company. Answer the user's "
    "question directly, in plain language, and keep the answer short unless the user asks for detail. When "
    "the question is about code, give a minimal example that runs, name the language, and explain each step "
    "in one sentence. When you are not sure of a fact, say so and say how the user could check it. Never "
    "invent names, numbers or references. If the request is unclear, ask one short question before you "
    "answer. Use lists for steps, and tables only when they make a comparison easier to read. Be polite, "
    "stay on topic, and do not repeat the question back to the user.\n\n")

BASELINE = {"quantization": "none", "dtype": "float32", "enforce_eager": True, "attention_backend": "torch",
            "kv_cache_dtype": "float32", "max_num_seqs": 1, "enable_prefix_caching": False,
            "kv_recent_window": None, "speculative_config": None, "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1}


@dataclass(frozen=True)
class Step:
    """One technique added to the stack: the engine arguments it sets (`change`)."""
    key: str
    title: str
    change: dict
    group: str = ""  # leave-one-out takes out the whole group (int8 then 4-bit weights are one: "weights")

    @property
    def technique(self) -> str:
        return self.group or self.key


@dataclass
class Config:
    name: str
    kind: str  # "baseline", "step", "leave-one-out"
    engine: dict
    skipped: str | None = None  # why this configuration cannot run (the engine's own refusal)
    runs: list[dict] = field(default_factory=list)


def parallel_change(cfg, cores: int) -> tuple[dict | None, str]:
    """Tensor parallelism over 2 ranks where the heads split evenly, else pipeline parallelism over 2 stages;
    None (and why) on one core."""
    if cores < 2:
        return None, "one core: no second rank to run"
    if cfg.num_heads % 2 == 0 and cfg.num_kv_heads % 2 == 0:
        return {"tensor_parallel_size": 2}, "tensor parallelism over 2 ranks, one core each"
    return ({"pipeline_parallel_size": 2},
            f"pipeline parallelism over 2 stages, one core each ({cfg.num_heads} query / {cfg.num_kv_heads} K/V heads "
            "do not split over 2 tensor-parallel ranks)")


def ablation_steps(cfg, cores: int, batch: int, spec: dict, four_bit: str, kv_window: int = 32) -> list[Step]:
    """The seed's order: weight quantization (INT8, then 4-bit), the fused kernels with the tiled attention
    kernel, continuous batching over the paged KV cache, prefix caching, speculative decoding, quantized K/V,
    then tensor/pipeline parallelism where the cores allow. The quantized K/V keeps its newest `kv_window`
    tokens in float16 (the engine's default, 128, would hold all of a short request's own tokens there)."""
    steps = [
        Step("int8", "INT8 weights", {"quantization": "int8"}, group="weights"),
        Step("4bit", f"4-bit weights ({four_bit})", {"quantization": four_bit}, group="weights"),
        Step("fused", "fused kernels + tiled attention", {"enforce_eager": False, "attention_backend": "cpu"}),
        Step("batching", f"continuous batching (up to {batch})", {"max_num_seqs": batch}),
        Step("prefix", "prefix caching", {"enable_prefix_caching": True}),
        Step("spec", f"speculative decoding ({spec['method']}, K={spec['num_speculative_tokens']})",
             {"speculative_config": spec}),
        Step("kv-int8", f"INT8 K/V ({kv_window} newest in float16)",
             {"kv_cache_dtype": "int8", "kv_recent_window": kv_window}),
    ]
    par, why = parallel_change(cfg, cores)
    if par is not None:
        steps.append(Step("parallel", why.split(",")[0].split(" (")[0], par))
    return steps


def _check(engine: dict) -> str | None:
    """None when the engine takes these arguments, else its own reason."""
    from turbollm.engine_args import EngineArgs

    try:
        EngineArgs.from_kwargs(**engine)
    except (InvalidRequestError, ValueError, TypeError) as e:
        return str(e)
    return None


def build_configs(model: str, steps: list[Step], common: dict) -> list[Config]:
    """The baseline, each step added to the one before, and the full stack less each technique."""
    base = {"model": model, **common, **BASELINE}
    out = [Config("baseline", "baseline", dict(base))]
    cur = dict(base)
    for s in steps:
        nxt = {**cur, **s.change}
        why = _check(nxt)
        if why is not None:  # a technique the stack so far refuses: recorded, the stack goes on without it
            out.append(Config("+ " + s.title, "step", nxt, skipped=why))
            continue
        cur = nxt
        out.append(Config("+ " + s.title, "step", dict(cur)))
    full = cur
    groups: dict[str, list[Step]] = {}
    for s in steps:
        groups.setdefault(s.technique, []).append(s)
    for tech, members in groups.items():
        keys = {k for s in members for k in s.change}
        if all(full.get(k) == BASELINE.get(k) for k in keys):
            continue  # not in the full stack (refused above)
        less = {**full, **{k: BASELINE[k] for k in keys}}
        title = " and ".join(s.title for s in members)
        out.append(Config("- " + title, "leave-one-out", less, skipped=_check(less)))
    return out


def build_prompts(tokenizer, num: int, max_input_len: int, data_dir=None,
                  system_prompt: str = SYSTEM_PROMPT) -> list[list[int]]:
    """`num` requests: the system prompt's tokens, then a ShareGPT prompt (cut to `max_input_len` tokens) in a
    plain user/assistant frame."""
    from turbollm.benchmarks.datasets import load_sharegpt_texts

    texts = load_sharegpt_texts(data_dir, num)
    if len(texts) < num:
        raise BenchmarkError(f"the ShareGPT file holds {len(texts)} prompts, {num} asked for")
    system = tokenizer.encode(system_prompt)
    out = []
    for t in texts:
        user = tokenizer.encode("User: " + t, add_special_tokens=False)[:max_input_len]
        out.append(system + user + tokenizer.encode("\nAssistant:", add_special_tokens=False))
    return out


def kv_budget_bytes(cfg, seq_tokens: int, seqs: int) -> int:
    """The float32 K/V bytes of `seqs` sequences of `seq_tokens` tokens, in blocks of 16 plus one spare block."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    blocks = math.ceil(seq_tokens / 16) + 1
    return per_token * 16 * blocks * seqs


def run_config(engine: dict, prompts: list[list[int]], max_tokens: int, timeout: float) -> dict:
    """One run of one configuration in a fresh process (ablation/run_one.py)."""
    with tempfile.TemporaryDirectory(prefix="turbollm-ablation-") as d:
        job, res = os.path.join(d, "job.json"), os.path.join(d, "result.json")
        with open(job, "w") as f:
            json.dump({"engine": engine, "prompts": prompts, "max_tokens": max_tokens}, f)
        try:
            out = subprocess.run([sys.executable, "-m", "turbollm.ablation.run_one", job, res],
                                 capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchmarkError(f"a configuration ran past {timeout:.0f} s: {engine}") from None
        if out.returncode != 0 or not os.path.exists(res):
            raise BenchmarkError(f"a configuration failed (exit {out.returncode}): {engine}\n{out.stderr[-1500:]}")
        with open(res) as f:
            return json.load(f)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Mean over requests of the share of the reference's tokens that `tokens` repeats before it first differs."""
    fr = []
    for a, b in zip(tokens, reference):
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        fr.append(n / max(1, len(b)))
    return sum(fr) / max(1, len(fr))


def summarize(run: dict, reference: list[list[int]] | None) -> dict:
    """The columns of one run."""
    tpot = [t for t in run["tpot"] if t > 0]
    return {
        "out_tok_s": run["output_tokens"] / run["seconds"],
        "per_user_tok_s": 1.0 / statistics.median(tpot) if tpot else None,
        "ttft_p50_ms": 1e3 * pct(run["ttft"], 0.5), "ttft_p99_ms": 1e3 * pct(run["ttft"], 0.99),
        "itl_p50_ms": 1e3 * pct(run["itl"], 0.5) if run["itl"] else None,
        "itl_p99_ms": 1e3 * pct(run["itl"], 0.99) if run["itl"] else None,
        "peak_gib": run["peak_bytes"] / 2**30, "kv_tokens": run["kv_tokens"], "most_running": run["most_running"],
        "seconds": run["seconds"], "preemptions": run["preemptions"],
        "agreement": agreement(run["tokens"], reference) if reference is not None else 1.0,
        "prefix_hit": (run["prefix_cache_hits"] / run["prefix_cache_queries"]) if run["prefix_cache_queries"] else 0.0,
        "spec_acceptance": (run["spec_accepted"] / run["spec_drafted"]) if run.get("spec_drafted") else None,
    }


def spread(values: list[float]) -> dict:
    v = [x for x in values if x is not None]
    if not v:
        return {"min": None, "median": None, "max": None}
    return {"min": min(v), "median": statistics.median(v), "max": max(v)}


@dataclass
class AblationReport:
    model: str
    setting: dict
    configs: list[Config]
    quality: dict  # "quantization/kv" -> perplexity, or the reason it is missing

    @staticmethod
    def summary(c: Config) -> dict | None:
        """Column -> {min, median, max} over `c`'s repeats (None: it did not run)."""
        if c.skipped or not c.runs:
            return None
        return {k: spread([run[k] for run in c.runs]) for k in c.runs[0]}

    def ppl_change(self, c: Config) -> float | None:
        base = self.quality.get(quality_key(BASELINE))
        mine = self.quality.get(quality_key(c.engine))
        if not isinstance(base, float) or not isinstance(mine, float):
            return None
        return mine / base - 1.0

    def factor(self, a: Config, b: Config) -> dict:
        """Out tok/s of `b` over `a`: the medians' ratio, and the widest ratio the repeats allow."""
        x = [r["out_tok_s"] for r in a.runs]
        y = [r["out_tok_s"] for r in b.runs]
        if not x or not y:
            return {"median": None, "min": None, "max": None}
        return {"median": statistics.median(y) / statistics.median(x), "min": min(y) / max(x), "max": max(y) / min(x)}

    def to_dict(self) -> dict:
        rows = []
        for c in self.configs:
            rows.append({"name": c.name, "kind": c.kind, "engine": c.engine, "skipped": c.skipped,
                         "summary": self.summary(c), "ppl_change": self.ppl_change(c),
                         "runs": [dict(r) for r in c.runs]})
        steps = [c for c in self.configs if c.kind in ("baseline", "step") and not c.skipped]
        base, full = steps[0], steps[-1]
        return {"model": self.model, "setting": self.setting, "quality_ppl": self.quality, "configs": rows,
                "stacked_speedup": self.factor(base, full),
                "step_factors": [{"name": b.name, **self.factor(a, b)} for a, b in zip(steps, steps[1:])],
                "leave_one_out": [{"name": c.name, **self.factor(c, full)}
                                  for c in self.configs if c.kind == "leave-one-out" and not c.skipped]}


def quality_key(engine: dict) -> str:
    """weights/K-V[/recent window]: what perplexity depends on."""
    w = engine.get("kv_recent_window")
    return f"{engine['quantization']}/{engine['kv_cache_dtype']}" + (f"/{w}" if w else "")


def run_ablation(model: str, *, num_prompts: int = 16, max_input_len: int = 128, max_tokens: int = 64,
                 repeats: int = 3, spec: dict | None = None, four_bit: str | None = None,
                 kv_cache_memory: int | None = None, kv_window: int = 32, ppl_tokens: int = 4096,
                 ppl_ctx: int = 512, timeout: float = 3600.0, data_dir=None, system_prompt: str = SYSTEM_PROMPT,
                 log=print) -> AblationReport:
    """Build the configurations, run each `repeats` times (interleaved) in its own process, measure the
    perplexity of each weights x K/V format, and return the report (see the module's docstring)."""
    from turbollm.benchmarks.kernel_bench import cpu_name
    from turbollm.eval.ppl_run import wikitext_ppl
    from turbollm.loader.model_loader import describe_model

    if repeats < 1 or num_prompts < 1 or max_tokens < 2:
        raise BenchmarkError("--repeats and --num-prompts must be >= 1, --max-tokens >= 2")
    desc = describe_model(model)
    cfg = desc.config
    is_gguf = desc.resolved.format.value == "gguf"
    four_bit = four_bit or ("gguf" if is_gguf else "int4")
    spec = spec or {"method": "ngram", "num_speculative_tokens": 3}
    prompts = build_prompts(desc.tokenizer, num_prompts, max_input_len, data_dir, system_prompt)
    longest = max(len(p) for p in prompts) + max_tokens
    kv_budget_default = kv_cache_memory is None
    if kv_budget_default:
        kv_cache_memory = kv_budget_bytes(cfg, longest, max(1, num_prompts // 4))
    cores = len(os.sched_getaffinity(0))
    common = {"kv_cache_memory": kv_cache_memory, "max_model_len": longest + 16, "seed": 0}
    steps = ablation_steps(cfg, cores, num_prompts, spec, four_bit, kv_window)
    configs = build_configs(model, steps, common)
    setting = {
        "model": model, "cpu": cpu_name(), "cores": cores, "date": time.strftime("%Y-%m-%d"),
        "requests": num_prompts, "system_prompt_tokens": len(desc.tokenizer.encode(system_prompt)),
        "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1), "new_tokens": max_tokens,
        "kv_cache_memory_mib": round(kv_cache_memory / 2**20, 1),
        "kv_budget_note": (f"float32 K/V of {max(1, num_prompts // 4)} of the {num_prompts} longest requests"
                           if kv_budget_default else "--kv-cache-memory"),
        "repeats": repeats, "spec": spec, "four_bit": four_bit,
        "parallel": parallel_change(cfg, cores)[1], "ppl": {"tokens": ppl_tokens, "ctx": ppl_ctx},
    }
    runnable = [c for c in configs if not c.skipped]
    for c in configs:
        if c.skipped:
            log(f"skipped {c.name}: {c.skipped}")
    t0, done, total = time.perf_counter(), 0, len(runnable) * repeats
    reference: list[list[int]] | None = None
    for r in range(repeats):
        for c in runnable:
            if c.skipped:
                continue
            try:
                res = run_config(c.engine, prompts, max_tokens, timeout)
            except BenchmarkError as e:
                if c.kind == "baseline":
                    raise
                c.skipped, c.runs = f"failed: {str(e).strip().splitlines()[-1]}", []
                log(f"{c.name} failed, left out of the report: {e}")
                continue
            if c.kind == "baseline" and reference is None:
                reference = res["tokens"]
            c.runs.append(summarize(res, reference))
            done += 1
            el = time.perf_counter() - t0
            row = c.runs[-1]
            log(f"[{done}/{total} {el / 60:.1f} min, ~{el / done * (total - done) / 60:.1f} min left] repeat {r + 1} "
                f"{c.name}: {row['out_tok_s']:.1f} out tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                f"peak {row['peak_gib']:.2f} GiB, agreement {row['agreement']:.2f}")
    quality: dict = {}
    for key in sorted({quality_key(c.engine) for c in runnable if not c.skipped}):
        q, kv, *w = key.split("/")
        log(f"WikiText-2 perplexity: {q} weights, {kv} K/V" + (f" ({w[0]} newest in float16)" if w else ""))
        try:
            quality[key] = wikitext_ppl(model, q, kv, ppl_tokens, ppl_ctx, dtype="float32",
                                        kv_recent_window=int(w[0]) if w else None)
        except BenchmarkError as e:
            quality[key] = f"not measured: {e}"
    return AblationReport(model, setting, configs, quality)
