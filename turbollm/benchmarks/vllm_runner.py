"""Run by `vllm_backend.py` in the vLLM interpreter: `python vllm_runner.py REQUEST.json RESULT.json` (REQUEST's
"mode": "throughput", the default, or "latency").

This file is executed by another Python (vLLM's own virtual environment), so it imports only
vLLM and the standard library, never turbollm. REQUEST.json holds the model folder, the engine
settings and the exact prompt token ids; RESULT.json receives the figures (or an error).

Measured: one untimed warm-up request, then the wall time of one `LLM.generate` call over all
requests (greedy, ignore_eos, max_tokens = each request's output length), as turbollm's
throughput benchmark times its own `LLM.generate`. The model load, vLLM's compilation and
warm-up happen when `LLM` is built, outside the timed region.

Latency (`bench latency --compare vllm`): each prompt alone, prefix caching off; one `generate` with
max_tokens = 1 gives the time to the first token, a second with max_tokens = output_len the end-to-end time; the
decode time per token is their difference over output_len - 1 (the first `warmup` prompts not counted).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _prompt(ids):
    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # a TypedDict: the plain dict is the same thing
        return {"prompt_token_ids": ids}
    return TokensPrompt(prompt_token_ids=ids)


def _engine_config(llm) -> dict:
    """What vLLM settled on (best effort: the attribute layout changes between versions)."""
    out = {}
    cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    for section, names in (("scheduler_config", ("max_num_seqs", "max_num_batched_tokens", "max_model_len")),
                           ("cache_config", ("block_size", "cache_dtype", "enable_prefix_caching")),
                           ("compilation_config", ("mode", "level")),
                           ("model_config", ("dtype", "enforce_eager"))):
        sub = getattr(cfg, section, None)
        for name in names:
            value = getattr(sub, name, None)
            if value is not None:
                out[f"{section.split('_')[0]}.{name}"] = str(value)
    return out


def run(req: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    kwargs = dict(model=req["model"], dtype=req.get("dtype", "float32"), seed=req.get("seed", 0))
    kwargs.update(req.get("llm_kwargs", {}))
    t_load = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t_load

    prompts = [_prompt(list(ids)) for ids in req["prompt_token_ids"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in req["output_lens"]]
    if req.get("warmup", True):
        warm = req.get("warmup_prompt") or list(req["prompt_token_ids"][0][:8])
        llm.generate([_prompt(warm)], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0

    got = [len(o.outputs[0].token_ids) for o in outs]
    prompt_tokens = sum(len(ids) for ids in req["prompt_token_ids"])
    output_tokens = sum(got)
    return {
        "backend": "vllm",
        "vllm_version": getattr(vllm, "__version__", "?"),
        "elapsed_s": round(elapsed, 3),
        "num_requests": len(outs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_lens": got,
        "requests_per_s": round(len(outs) / elapsed, 3),
        "output_tok_per_s": round(output_tokens / elapsed, 2),
        "total_tok_per_s": round((prompt_tokens + output_tokens) / elapsed, 2),
        "load_and_compile_s": round(load_s, 1),
        "llm_kwargs": {k: v for k, v in kwargs.items() if k != "model"},
        "engine_config": _engine_config(llm),
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU") or k == "OMP_NUM_THREADS"},
    }


def run_latency(req: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    kwargs = dict(model=req["model"], dtype=req.get("dtype", "auto"), seed=req.get("seed", 0),
                  enable_prefix_caching=False, max_model_len=req["max_model_len"], max_num_seqs=1)
    t_load = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t_load
    n = req["output_len"]
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    whole = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    ttfts, decode, lens = [], [], []
    for i, ids in enumerate(req["prompts"]):
        t0 = time.perf_counter()
        llm.generate([_prompt(list(ids))], first, use_tqdm=False)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = llm.generate([_prompt(list(ids))], whole, use_tqdm=False)
        e2e = time.perf_counter() - t0
        lens.append(len(out[0].outputs[0].token_ids))
        if i >= req["warmup"]:
            ttfts.append(ttft)
            decode.append((e2e - ttft) / (n - 1))
    ttft = sum(ttfts) / len(ttfts)
    step = sum(decode) / len(decode)
    return {
        "backend": "vllm", "vllm_version": getattr(vllm, "__version__", "?"), "iterations": len(ttfts),
        "ttft_ms_mean": round(1000 * ttft, 2), "prefill_tok_per_s": round(len(req["prompts"][-1]) / ttft, 2),
        "decode_steps": len(decode) * (n - 1), "decode_ms_per_step_mean": round(1000 * step, 3),
        "decode_tok_per_s": round(1 / step, 2), "output_lens": lens, "load_and_compile_s": round(load_s, 1),
        "llm_kwargs": {k: v for k, v in kwargs.items() if k != "model"}, "engine_config": _engine_config(llm),
        "timing": "TTFT: a max_tokens=1 generate; decode: (end-to-end - TTFT) / (output_len - 1); prefix caching off",
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vllm_runner.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        req = json.load(f)
    result = run_latency(req) if req.get("mode") == "latency" else run(req)
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
