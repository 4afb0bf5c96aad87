"""Run by `openvino_backend.py` in OpenVINO GenAI's interpreter: `python openvino_runner.py REQUEST.json RESULT.json`
(REQUEST's "mode": "throughput", the default, or "latency").

Executed by another Python (a virtual environment holding openvino-genai), so it imports only OpenVINO GenAI,
numpy and the standard library, never turbollm. REQUEST.json holds the exported model folder, the scheduler
settings, the threads and the exact prompt token ids; RESULT.json receives the figures.

Measured as vLLM's runner and turbollm's own throughput benchmark do: the pipeline is built (model compiled for
the CPU) and one tiny request run outside the timed region, then the wall time of one `generate` call over all
requests on the continuous-batching pipeline (greedy, ignore_eos, every request exactly its output length).
Latency (`bench latency --compare openvino`): the `LLMPipeline` (its single-request path) runs each prompt
alone, greedy, exactly output_len tokens; TTFT and the time per output token are OpenVINO GenAI's own
`perf_metrics` (from the call to the first token, then per token), the first `warmup` prompts not counted.
OpenVINO's own defaults stand (on a CPU with AVX512_BF16 / AMX its inference precision is bfloat16; int8 / int4
weights run with int8 activations where it chooses to); what it settled on is read back and reported.
"""

from __future__ import annotations

import json
import sys
import time


def _tensor(ids):
    import numpy as np
    import openvino as ov

    return ov.Tensor(np.array([ids], dtype=np.int64))


def _config(n: int):
    import openvino_genai as ovg

    cfg = ovg.GenerationConfig()
    cfg.max_new_tokens = n
    cfg.min_new_tokens = n
    cfg.ignore_eos = True
    cfg.do_sample = False
    return cfg


def _lens(results) -> list[int]:
    out = []
    for r in results:
        ids = getattr(r, "m_generation_ids", None)
        if ids is None:  # EncodedResults-like
            ids = getattr(r, "tokens", None)
        out.append(len(ids[0]) if ids else 0)
    return out


def run(req: dict) -> dict:
    import openvino as ov
    import openvino_genai as ovg

    sched = ovg.SchedulerConfig()
    sched.max_num_seqs = req["max_num_seqs"]
    sched.max_num_batched_tokens = req["max_num_batched_tokens"]
    sched.cache_size = req["kv_cache_gib"]
    sched.enable_prefix_caching = True
    props = {"INFERENCE_NUM_THREADS": req["threads"]}
    t_load = time.perf_counter()
    pipe = ovg.ContinuousBatchingPipeline(req["model"], sched, "CPU", props)
    load_s = time.perf_counter() - t_load

    if req.get("warmup", True):
        pipe.generate([_tensor(list(req["prompt_token_ids"][0][:8]))], [_config(2)])
    prompts = [_tensor(list(ids)) for ids in req["prompt_token_ids"]]
    configs = [_config(n) for n in req["output_lens"]]
    t0 = time.perf_counter()
    results = pipe.generate(prompts, configs)
    elapsed = time.perf_counter() - t0

    got = _lens(results)
    prompt_tokens = sum(len(ids) for ids in req["prompt_token_ids"])
    output_tokens = sum(got)
    core = ov.Core()
    settled = {}
    for name in ("INFERENCE_PRECISION_HINT", "INFERENCE_NUM_THREADS", "KV_CACHE_PRECISION"):
        try:
            settled[name] = str(core.get_property("CPU", name))
        except Exception:  # noqa: BLE001 - a property this version does not have
            pass
    return {
        "backend": "openvino",
        "openvino_version": ov.get_version(),
        "openvino_genai_version": getattr(ovg, "__version__", "?"),
        "elapsed_s": round(elapsed, 3),
        "num_requests": len(got),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_lens": got,
        "requests_per_s": round(len(got) / elapsed, 3),
        "output_tok_per_s": round(output_tokens / elapsed, 2),
        "total_tok_per_s": round((prompt_tokens + output_tokens) / elapsed, 2),
        "load_and_compile_s": round(load_s, 1),
        "scheduler": {"max_num_seqs": req["max_num_seqs"], "max_num_batched_tokens": req["max_num_batched_tokens"],
                      "cache_size_GB": req["kv_cache_gib"], "enable_prefix_caching": True},
        "cpu_properties_default": settled,
        "threads": req["threads"],
    }


def run_latency(req: dict) -> dict:
    import openvino as ov
    import openvino_genai as ovg

    t_load = time.perf_counter()
    pipe = ovg.LLMPipeline(req["model"], "CPU", INFERENCE_NUM_THREADS=req["threads"])
    load_s = time.perf_counter() - t_load
    ttfts, tpots, steps, lens = [], [], 0, []
    for i, ids in enumerate(req["prompts"]):
        res = pipe.generate(_tensor(list(ids)), _config(req["output_len"]))
        got = len(res.tokens[0])
        lens.append(got)
        if i < req["warmup"]:
            continue
        pm = res.perf_metrics
        ttfts.append(pm.get_ttft().mean)
        tpots.append(pm.get_tpot().mean)
        steps += got - 1
    ttft = sum(ttfts) / len(ttfts)
    tpot = sum(tpots) / len(tpots)
    return {
        "backend": "openvino",
        "openvino_version": ov.get_version(),
        "openvino_genai_version": getattr(ovg, "__version__", "?"),
        "iterations": len(ttfts),
        "ttft_ms_mean": round(ttft, 2),
        "prefill_tok_per_s": round(len(req["prompts"][-1]) / ttft * 1000, 2),
        "decode_steps": steps,
        "decode_ms_per_step_mean": round(tpot, 3),
        "decode_tok_per_s": round(1000 / tpot, 2),
        "output_lens": lens,
        "load_and_compile_s": round(load_s, 1),
        "threads": req["threads"],
        "timing": "OpenVINO GenAI's perf_metrics: TTFT and mean time per output token, per prompt, averaged",
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: openvino_runner.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        req = json.load(f)
    result = run_latency(req) if req.get("mode") == "latency" else run(req)
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
