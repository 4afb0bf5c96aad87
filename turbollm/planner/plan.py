"""One engine configuration and one workload, planned: memory, the concurrency that fits, step times and the
workload's predicted latencies and throughput (`turbollm plan`)."""

from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass

from turbollm.planner.cost_model import StepShape
from turbollm.planner.memory import (MiB, MemoryPlan, activation_bytes, estimated_model_runtime, tensor_table,
                                     vocab_bytes, weight_bytes)
from turbollm.planner.profile import Profile, measure_base
from turbollm.planner.simulate import SimResult, simulate
from turbollm.planner.workload import Workload
from turbollm.procfs import available_memory


@dataclass
class Plan:
    model: str
    arch: str
    weights_format: str
    kv_format: str
    kv_tokens: int | None  # what the KV pool holds (None: sequences at flat memory)
    kv_bytes_per_token: float
    max_model_len: int
    memory: MemoryPlan
    available_bytes: int
    concurrency: int  # requests of the workload's mean length that run at once
    workload: Workload
    max_num_seqs: int
    max_num_batched_tokens: int
    profile: Profile | None = None
    sim: SimResult | None = None
    weight_read_bytes: int = 0  # bytes a decode step reads (the resident weights)
    step_flops_per_token: float = 0.0

    def decode_step(self, batch: int, context: int) -> float | None:
        if self.profile is None:
            return None
        return self.profile.cost.predict(StepShape.decode([context] * batch))

    def prefill_step(self, tokens: int) -> float | None:
        if self.profile is None:
            return None
        return self.profile.cost.predict(StepShape((tokens,), (0,)))

    def to_dict(self) -> dict:
        w = self.workload
        d = {"model": self.model, "arch": self.arch, "weights": self.weights_format, "kv_cache_dtype": self.kv_format,
             "kv_tokens": self.kv_tokens, "kv_bytes_per_token": round(self.kv_bytes_per_token, 1),
             "max_model_len": self.max_model_len, "memory_MiB": self.memory.to_dict(),
             "available_MiB": round(self.available_bytes / MiB), "fits": self.memory.peak <= self.available_bytes,
             "workload": {"name": w.name, "requests": len(w.items), "mean_in": round(w.mean_in, 1),
                          "mean_out": round(w.mean_out, 1)},
             "concurrency": self.concurrency, "max_num_seqs": self.max_num_seqs,
             "max_num_batched_tokens": self.max_num_batched_tokens}
        if self.profile is not None:
            ctx = int(w.mean_in + w.mean_out / 2)
            b = max(1, self.concurrency)
            d["steps_ms"] = {"decode_batch1": _ms(self.decode_step(1, ctx)), f"decode_batch{b}": _ms(self.decode_step(b, ctx)),
                             f"prefill_{int(w.mean_in)}": _ms(self.prefill_step(max(1, int(w.mean_in))))}
            d["profile"] = {"key": self.profile.key, "cpu": self.profile.cpu, "threads": self.profile.threads,
                            "fit_error": self.profile.cost.fit_error, "steps": self.profile.cost.fit_steps,
                            "seconds": round(self.profile.seconds, 1)}
        if self.sim is not None:
            s = self.sim
            d["predicted"] = {"duration_s": round(s.duration, 2), "output_tok_s": round(s.output_tok_s, 1),
                              "requests_per_s": round(s.requests_per_s, 3),
                              "ttft_ms": _pcts(s.ttft), "itl_ms": _pcts(s.itl), "steps": s.steps,
                              "peak_running": s.peak_running, "peak_kv_tokens": s.peak_kv_tokens,
                              "preemptions": s.preemptions}
        return d


def _ms(v: float | None) -> float | None:
    return None if v is None else round(1e3 * v, 2)


def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    return {"p50": round(1e3 * statistics.median(xs), 1), "p99": round(1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 1)}


def make_plan(args, workload: Workload, profile: Profile | None, base_bytes: int | None = None) -> Plan:
    """The plan for engine arguments `args` (an EngineArgs) on `workload`; `profile` (planner/profile.py) gives the
    step times and the model's measured runtime memory; without one, memory only (the runtime estimated)."""
    from turbollm.core.kv_policy import get_kv_policy
    from turbollm.core.kv_sizing import batched_tokens, size_kv_cache
    from turbollm.engine_args import dense_bfloat16
    from turbollm.loader.model_loader import describe_model

    desc = describe_model(args.model, quantization=args.quantization)
    cfg = desc.config
    dtype = args.kv_torch_dtype(desc.quantization)
    kv, model_len = size_kv_cache(args, cfg, dtype, b"")
    table = tensor_table(desc.resolved)
    dense = 2 if dense_bfloat16(args.dtype) else 4
    weights = weight_bytes(table, desc.quantization, dense)
    budget = min(batched_tokens(args), max(it.prompt_len for it in workload.items) * args.max_num_seqs)
    rows = min(args.max_num_seqs, len(workload.items))
    base = profile.base_bytes if profile is not None else (base_bytes or measure_base())
    runtime = profile.model_runtime_bytes if profile is not None else estimated_model_runtime(cfg)
    memory = MemoryPlan(base, runtime, weights, kv.total_bytes * args.tensor_parallel_size,
                        activation_bytes(cfg, budget, rows, profile.activation_bytes_per_token if profile else None),
                        profile is not None)
    per_req = workload.mean_in + workload.mean_out
    held = kv.num_tokens
    concurrency = args.max_num_seqs if held is None else max(0, min(args.max_num_seqs, int(held // per_req)))
    plan = Plan(args.model, cfg.arch, desc.quantization + (" (dense bfloat16)" if dense_bfloat16(args.dtype) else ""),
                kv.format_name, held, kv.bytes_per_token, model_len, memory, available_memory(), concurrency, workload,
                args.max_num_seqs, batched_tokens(args), profile)
    # a decode step reads the layers' weights and the LM head (the embedding only one row a token)
    vocab = [vocab_bytes(v, desc.quantization, dense) for v in table.vocab]
    plan.weight_read_bytes = weights - table.other_bytes - (sum(vocab) - max(vocab, default=0))
    plan.step_flops_per_token = 2.0 * table.linear_params
    if profile is not None:
        fits = [it for it in workload.items if it.prompt_len + it.output_len <= model_len]
        wl = Workload(workload.name, tuple(fits)) if fits else workload
        plan.sim = simulate(wl, profile.cost, args.max_num_seqs, batched_tokens(args),
                            held, args.block_size)
        # the pages a run commits: freed blocks whose prefix is cached queue up last (the whole pool cycles
        # through), others are reused first (the peak in use)
        caching = args.enable_prefix_caching and not get_kv_policy(args.kv_policy).evicts
        blocks = plan.sim.blocks_allocated if caching else plan.sim.peak_blocks
        if kv.ring_blocks:  # a quantized format: each running sequence's float16 ring of recent tokens takes
            # blocks, and a sequence's own blocks are written only as its tokens age out of the ring
            window = args.kv_recent_window or 0
            blocks += kv.ring_blocks * min(plan.sim.peak_running, kv.ring_slots or plan.sim.peak_running)
            unwritten = sum(min(window, it.prompt_len + it.output_len) // args.block_size for it in wl.items)
            blocks = max(0, blocks - (unwritten if caching else unwritten * plan.sim.peak_running // len(wl.items)))
        per_block = memory.kv_cache / max(1, kv.num_blocks)
        act = activation_bytes(cfg, plan.sim.max_step_tokens, min(rows, plan.sim.peak_running),
                               profile.activation_bytes_per_token)  # the largest step this run makes
        plan.memory = dataclasses.replace(memory, kv_touched=int(min(kv.num_blocks, blocks) * per_block),
                                          activations=act)
    return plan


def render(plan: Plan) -> str:
    d = plan.to_dict()
    m = plan.memory
    w = plan.workload
    lines = [f"plan: {plan.model} ({plan.arch}), weights {plan.weights_format}, K/V {plan.kv_format}, "
             f"max_num_seqs {plan.max_num_seqs}, max_num_batched_tokens {plan.max_num_batched_tokens}, "
             f"{os.cpu_count()} cores",
             f"workload: {w.name}, {len(w.items)} requests, mean {w.mean_in:.0f} in / {w.mean_out:.0f} out tokens",
             "",
             "memory (MiB)           predicted",
             f"  runtime (torch etc.)  {m.base / MiB:9.1f}",
             f"  model runtime         {m.model_runtime / MiB:9.1f}  "
             f"({'measured by the profile' if m.model_runtime_measured else 'estimated from the vocabulary: no profile'})",
             f"  weights               {m.weights / MiB:9.1f}",
             f"  KV cache              {m.kv_cache / MiB:9.1f}  "
             + (f"({plan.kv_tokens} tokens, {plan.kv_bytes_per_token:.0f} B/token)" if plan.kv_tokens
                else "(flat per sequence)"),
             f"  activations           {m.activations / MiB:9.1f}",
             f"  serving peak          {m.total / MiB:9.1f}  (KV pool in use to its last block)",
             *([f"  this workload's peak  {m.workload_total / MiB:9.1f}  (the KV pages its run writes)"]
               if m.workload_total is not None else []),
             f"  loading peak          {m.load_peak / MiB:9.1f}  (the mapped file beside the weights)",
             f"  available now         {plan.available_bytes / MiB:9.1f}  "
             + ("fits" if d["fits"] else "DOES NOT FIT: lower kv_cache_memory or max_num_seqs"),
             "",
             f"concurrency: {plan.concurrency} requests of {w.mean_in + w.mean_out:.0f} tokens in the KV cache at once "
             f"(max_num_seqs {plan.max_num_seqs})"]
    if plan.profile is None:
        lines.append("step times: no profile (run without --no-profile to measure one)")
        return "\n".join(lines)
    ctx = int(w.mean_in + w.mean_out / 2)
    b = max(1, plan.concurrency)
    d1, db, pf = plan.decode_step(1, ctx), plan.decode_step(b, ctx), plan.prefill_step(max(1, int(w.mean_in)))
    fe = plan.profile.cost.fit_error
    lines += ["",
              f"step times (cost model: {plan.profile.cost.fit_steps} profiled steps, median error "
              f"{100 * fe['median']:.1f}%, p90 {100 * fe['p90']:.1f}%; {plan.profile.cpu}, {plan.profile.threads} threads)",
              f"  decode, batch 1, context {ctx}: {1e3 * d1:8.2f} ms  ({plan.weight_read_bytes / d1 / 1e9:.1f} GB/s of "
              f"layer weights, {1 / d1:.1f} tok/s)",
              f"  decode, batch {b}: {1e3 * db:8.2f} ms  ({b / db:.1f} tok/s)",
              f"  prefill of {int(w.mean_in)} tokens: {1e3 * pf:8.2f} ms  "
              f"({plan.step_flops_per_token * int(w.mean_in) / pf / 1e9:.1f} GFLOP/s in the linear layers)"]
    if plan.sim is not None:
        p = d["predicted"]
        lines += ["",
                  f"predicted run ({p['steps']} steps, peak {p['peak_running']} running, {p['preemptions']} preemptions):",
                  f"  {p['output_tok_s']} output tok/s, {p['requests_per_s']} requests/s, {p['duration_s']} s",
                  f"  TTFT p50 {p['ttft_ms'].get('p50')} ms, p99 {p['ttft_ms'].get('p99')} ms; "
                  f"ITL p50 {p['itl_ms'].get('p50')} ms, p99 {p['itl_ms'].get('p99')} ms"]
    return "\n".join(lines)
