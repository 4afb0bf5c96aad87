"""Offline throughput of turbollm: every request submitted at once to `LLM.generate`, timed.

Measured: wall time of one `LLM.generate` call over all requests (greedy, `ignore_eos`, each
request generating exactly its `output_len` tokens; prompts are token ids, so tokenization is
not timed, detokenization is: the engine detokenizes as it goes). From it: requests/s,
output tok/s, total tok/s (prompt + output). A `StepRecorder` adds the engine's view: steps,
mean batch (sequences per step), preemptions, prefix-cache hits, and the physics over all
steps and over the pure-decode steps alone (weight GB/s = bytes read per step × steps/s;
GFLOP/s over the matmul parameters; see `physics.py`).
"""

from __future__ import annotations

import time

import torch

from turbollm.benchmarks.datasets import BenchRequest, random_prompt_ids
from turbollm.benchmarks.physics import Ceilings, ModelPhysics, bandwidth_figures, compute_figures
from turbollm.benchmarks.step_stats import StepRecorder, summarize_steps
from turbollm.errors import BenchmarkError


def _greedy(output_len: int):
    from turbollm.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)


def _prefix_hits(engine) -> int | None:
    stats = getattr(getattr(engine, "kv_manager", None), "stats", None)
    return getattr(stats, "hits", None)


def warmup_turbollm(llm, num_tokens: int = 8, output_len: int = 2) -> None:
    """One tiny request (random ids of its own: nothing it caches matches a benchmark prompt)."""
    ids = random_prompt_ids(llm.get_tokenizer(), num_tokens, torch.Generator().manual_seed(987654321))
    llm.generate([{"prompt_token_ids": ids}], _greedy(output_len), use_tqdm=False)


def run_turbollm_throughput(llm, requests: list[BenchRequest], phys: ModelPhysics, ceilings: Ceilings,
                            warmup: bool = True, use_tqdm: bool = False) -> dict:
    """Time `llm.generate` on all `requests` at once; return the figures (see the module docstring)."""
    engine = llm.engine
    if warmup:
        warmup_turbollm(llm)
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    params = [_greedy(r.output_len) for r in requests]
    preempt0 = getattr(engine.scheduler, "num_preemptions", None)
    hits0 = _prefix_hits(engine)
    comm0 = engine.executor.comm_stats()  # parallel ranks: each one's collectives and sends so far
    with StepRecorder(engine) as rec:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    short = [(i, g, r.output_len) for i, (g, r) in enumerate(zip(got, requests)) if g != r.output_len]
    if short:
        i, g, want = short[0]
        raise BenchmarkError(f"request {i} generated {g} tokens instead of {want} ({len(short)} such requests): "
                             f"the throughput figures would not be comparable")
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(got)
    steps = summarize_steps(rec.records, phys)
    res = {
        "backend": "turbollm",
        "elapsed_s": round(elapsed, 3),
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": round(len(requests) / elapsed, 3),
        "output_tok_per_s": round(output_tokens / elapsed, 2),
        "total_tok_per_s": round((prompt_tokens + output_tokens) / elapsed, 2),
        "steps": steps["steps"],
        "time_outside_steps_s": round(elapsed - steps["step_seconds"], 3),
    }
    if preempt0 is not None:
        res["preemptions"] = engine.scheduler.num_preemptions - preempt0
    if hits0 is not None:
        res["prefix_cache_hit_tokens"] = _prefix_hits(engine) - hits0
    if "processed_tokens" in steps:
        res.update(mean_batch_seqs=round(steps["mean_batch_seqs"], 2), max_batch_seqs=steps["max_batch_seqs"],
                   mean_tokens_per_step=round(steps["mean_tokens_per_step"], 1),
                   processed_tokens=steps["processed_tokens"])
        processed, sampled = steps["processed_tokens"], steps["sampled_rows"]
    else:  # composition unknown: every prompt token and every output token but the last went through
        processed, sampled = prompt_tokens + output_tokens - len(requests), output_tokens
    physics = {"all_steps": {**bandwidth_figures(phys, steps["steps"], elapsed, ceilings, steps.get("kv_bytes", 0)),
                             **compute_figures(phys, processed, sampled, elapsed, ceilings)}}
    if steps.get("decode_steps"):
        ds, dt = steps["decode_steps"], steps["decode_seconds"]
        physics["decode_steps"] = {
            "steps": ds, "seconds": round(dt, 3), "mean_batch_seqs": round(steps["decode_mean_batch"], 2),
            "tok_per_s": round(steps["decode_tokens"] / dt, 2), "ms_per_step": round(1000 * dt / ds, 2),
            **bandwidth_figures(phys, ds, dt, ceilings, steps["decode_kv_bytes"]),
            **compute_figures(phys, steps["decode_tokens"], steps["decode_tokens"], dt, ceilings)}
    res["physics"] = physics
    if comm0 is not None:
        res["parallel"] = parallel_figures(comm0, engine.executor.comm_stats(), steps["steps"], elapsed)
    return res


def parallel_figures(before: list[dict], after: list[dict], steps: int, elapsed: float) -> dict:
    """The slowest rank's time in collectives, in sends and waiting on receives over the run, per step and as
    a share of the run (a receive's wait includes the stage before's compute)."""
    def worst(key: str) -> float:
        return max(b[key] - a[key] for a, b in zip(before, after))

    out = {"ranks": len(after)}
    for key, name in (("seconds", "collective"), ("send_seconds", "send"), ("recv_seconds", "recv_wait")):
        t = worst(key)
        out[f"{name}_ms_per_step"] = round(1000 * t / max(1, steps), 3)
        out[f"{name}_share"] = round(t / elapsed, 3)
    out["collectives_per_step"] = round(worst("calls") / max(1, steps), 1)
    out["sends_per_step"] = round(worst("sends") / max(1, steps), 1)
    return out


def side_by_side(turbo: dict, hf_best: dict) -> dict:
    """The acceptance ratio: turbollm output tok/s ÷ transformers output tok/s (its best batch size)."""
    ratio = turbo["output_tok_per_s"] / hf_best["output_tok_per_s"] if hf_best["output_tok_per_s"] else float("inf")
    return {"turbollm_output_tok_per_s": turbo["output_tok_per_s"],
            "hf_output_tok_per_s": hf_best["output_tok_per_s"], "hf_batch_size": hf_best["batch_size"],
            "ratio_output_tok_per_s": round(ratio, 3),
            "ratio_total_tok_per_s": round(turbo["total_tok_per_s"] / hf_best["total_tok_per_s"], 3)}
