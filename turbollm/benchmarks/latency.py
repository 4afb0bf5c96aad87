"""Latency of one batch through the engine's step loop: time to first token, then per-token decode.

Each iteration submits `batch_size` requests of exactly `input_len` random token ids (a fresh
seeded draw per request and iteration, so nothing hits the prefix cache; special tokens
excluded) with `output_len` greedy tokens (`ignore_eos`), and drives `LLMEngine.step()`:
- TTFT (prefill): from submitting the batch to the end of the step in which the last of its
  requests got its first token (one step, or several when the prompts exceed
  `max_num_batched_tokens` and prefill is chunked);
- decode latency: the duration of each later step (one token for each running sequence);
  mean, p50, p90 over all measured iterations;
- prefill tok/s = batch × input_len / TTFT; decode tok/s = decode tokens / decode time.
Physics: decode GB/s = weight bytes read per step / mean decode step time (and with the
ideal KV reads added); prefill GFLOP/s over the matmul parameters. `warmup` iterations run
first and are not counted.
"""

from __future__ import annotations

import statistics
import time

import torch

from turbollm.benchmarks.datasets import random_prompt_ids
from turbollm.benchmarks.physics import (Ceilings, ModelPhysics, bandwidth_figures, compute_figures,
                                         decode_ceiling_steps_per_s)
from turbollm.errors import BenchmarkError


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _one_iteration(engine, prompts: list[list[int]], output_len: int) -> dict:
    from turbollm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    counts: dict[str, int] = {}
    lengths: dict[str, int] = {}
    t0 = time.perf_counter()
    for ids in prompts:
        rid = engine.add_request({"prompt_token_ids": ids}, params)
        counts[rid], lengths[rid] = 0, len(ids)
    ttft, prefill_steps, decode_steps, decode_tokens, contexts = None, 0, [], 0, []
    comm = [engine.executor.comm_stats()]  # parallel ranks: each one's collectives and sends, at the phase ends
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        outs = engine.step()
        te = time.perf_counter()
        new, ctx = 0, []
        for o in outs:
            if o.request_id in counts:
                n = len(o.outputs[0].token_ids)
                if n > counts[o.request_id]:
                    new += n - counts[o.request_id]
                    ctx.append(lengths[o.request_id] + n - 1)  # tokens in the cache after this step
                counts[o.request_id] = n
        if ttft is None:
            prefill_steps += 1
            if all(counts.values()):
                ttft = te - t0
                comm.append(engine.executor.comm_stats())
        elif new:
            decode_steps.append(te - ts)
            decode_tokens += new
            contexts.append(ctx)
    if any(n != output_len for n in counts.values()):
        raise BenchmarkError(f"requests generated {sorted(set(counts.values()))} tokens instead of {output_len}")
    e2e = time.perf_counter() - t0
    comm.append(engine.executor.comm_stats())
    return {"ttft": ttft, "prefill_steps": prefill_steps, "decode_steps": decode_steps,
            "decode_tokens": decode_tokens, "e2e": e2e, "contexts": contexts,
            "comm": None if comm[0] is None else comm}


def _collectives(iters: list[dict]) -> dict | None:
    """Time in collectives and pipeline sends per rank (the slowest rank's), per prefill and per decode
    step, beside the step times: what tensor and pipeline parallelism spend talking instead of computing.
    A stage's receive time is its wait for the stage before: transfer and the other stage's compute."""
    if iters[0]["comm"] is None:
        return None

    def delta(r: dict, a: int, b: int, key: str) -> list[float]:
        return [y[key] - x[key] for x, y in zip(r["comm"][a], r["comm"][b])]

    def worst(key: str, a: int, b: int) -> list[float]:
        return [max(delta(r, a, b, key)) for r in iters]

    prefill, decode = worst("seconds", 0, 1), worst("seconds", 1, 2)
    steps = sum(len(r["decode_steps"]) for r in iters)
    decode_time = sum(sum(r["decode_steps"]) for r in iters)
    ttft_time = sum(r["ttft"] for r in iters)
    calls = sum(max(delta(r, 1, 2, "calls")) for r in iters)
    nbytes = sum(max(delta(r, 1, 2, "bytes")) for r in iters)
    out = {"ranks": len(iters[0]["comm"][0]),
           "prefill_collective_ms": round(1000 * statistics.mean(prefill), 2),
           "prefill_collective_share": round(sum(prefill) / ttft_time, 3),
           "decode_collective_ms_per_step": round(1000 * sum(decode) / steps, 3),
           "decode_collective_share": round(sum(decode) / decode_time, 3),
           "decode_collectives_per_step": round(calls / steps, 1),
           "decode_collective_bytes_per_step": round(nbytes / steps)}
    if any(max(delta(r, 0, 2, "sends")) for r in iters):  # pipeline stages
        sends, recvs = worst("send_seconds", 1, 2), worst("recv_seconds", 1, 2)
        out |= {"prefill_send_ms": round(1000 * statistics.mean(worst("send_seconds", 0, 1)), 2),
                "prefill_recv_wait_ms": round(1000 * statistics.mean(worst("recv_seconds", 0, 1)), 2),
                "decode_send_ms_per_step": round(1000 * sum(sends) / steps, 3),
                "decode_recv_wait_ms_per_step": round(1000 * sum(recvs) / steps, 3),
                "decode_recv_wait_share": round(sum(recvs) / decode_time, 3),
                "decode_sends_per_step": round(sum(max(delta(r, 1, 2, "sends")) for r in iters) / steps, 1),
                "decode_send_bytes_per_step": round(sum(max(delta(r, 1, 2, "send_bytes")) for r in iters) / steps)}
    return out


def latency_prompts(tokenizer, input_len: int, count: int, seed: int = 0) -> list[list[int]]:
    """The prompts of a latency run, in the order its iterations take them (`batch_size` each, warm-up first):
    a peer measured beside it (`--compare`) gets the very same ones."""
    gen = torch.Generator().manual_seed(seed)
    return [random_prompt_ids(tokenizer, input_len, gen) for _ in range(count)]


def peer_ratios(ours: dict, theirs: dict) -> dict:
    """turbollm ÷ a peer's batch-1 figures: decode and prefill tok/s."""
    return {key: round(ours[key] / theirs[key], 3) for key in ("decode_tok_per_s", "prefill_tok_per_s")}


def run_latency(engine, phys: ModelPhysics, ceilings: Ceilings, input_len: int, output_len: int,
                batch_size: int = 1, num_iters: int = 3, warmup: int = 1, seed: int = 0) -> dict:
    """Measure TTFT and decode latency (see the module docstring); return the figures."""
    if input_len + output_len > engine.max_model_len:
        raise BenchmarkError(f"--input-len {input_len} + --output-len {output_len} exceeds the context of "
                             f"{engine.max_model_len} tokens")
    if output_len < 2:
        raise BenchmarkError("--output-len must be at least 2 (one prefill token and one decode token)")
    prompts = latency_prompts(engine.tokenizer, input_len, (warmup + num_iters) * batch_size, seed)
    preempt0 = getattr(engine.scheduler, "num_preemptions", None)
    iters = []
    for i in range(warmup + num_iters):
        res = _one_iteration(engine, prompts[i * batch_size:(i + 1) * batch_size], output_len)
        if i >= warmup:
            iters.append(res)
    ttfts = [r["ttft"] for r in iters]
    steps = [s for r in iters for s in r["decode_steps"]]
    decode_time = sum(steps)
    decode_tokens = sum(r["decode_tokens"] for r in iters)
    mean_step = decode_time / len(steps)
    ttft = statistics.mean(ttfts)
    kv = sum(phys.kv_bytes_read(c) for r in iters for ctxs in r["contexts"] for c in ctxs)
    prompt_tokens = batch_size * input_len
    out = {
        "iterations": num_iters,
        "ttft_ms_mean": round(1000 * ttft, 2),
        "ttft_ms_min": round(1000 * min(ttfts), 2),
        "ttft_ms_max": round(1000 * max(ttfts), 2),
        "prefill_steps": iters[0]["prefill_steps"],
        "prefill_tok_per_s": round(prompt_tokens / ttft, 2),
        "decode_steps": len(steps),
        "decode_ms_per_step_mean": round(1000 * mean_step, 3),
        "decode_ms_per_step_p50": round(1000 * percentile(steps, 50), 3),
        "decode_ms_per_step_p90": round(1000 * percentile(steps, 90), 3),
        "decode_tok_per_s": round(decode_tokens / decode_time, 2),
        "e2e_s_mean": round(statistics.mean(r["e2e"] for r in iters), 3),
        "output_tokens": sum(r["decode_tokens"] for r in iters) + batch_size * num_iters,
        "physics": {
            "decode": {**bandwidth_figures(phys, len(steps), decode_time, ceilings, kv),
                       **compute_figures(phys, decode_tokens, decode_tokens, decode_time, ceilings),
                       "roofline_steps_per_s": round(decode_ceiling_steps_per_s(phys, ceilings), 1)},
            "prefill": {**compute_figures(phys, prompt_tokens * num_iters, batch_size * num_iters, sum(ttfts), ceilings),
                        **bandwidth_figures(phys, iters[0]["prefill_steps"] * num_iters, sum(ttfts), ceilings)},
        },
    }
    if preempt0 is not None:
        out["preemptions"] = engine.scheduler.num_preemptions - preempt0
    collectives = _collectives(iters)
    if collectives is not None:
        out["parallel"] = collectives
    return out
