"""turbollm's side of a benchmark against a peer engine (`bench throughput --backend vllm | openvino`): the same
requests through turbollm on the peer's HF fp32 folder (in float32, and at `--dtype` when that is not float32) and
on turbollm's own default for the model (a GGUF's block types), each run's setting and figures recorded."""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from turbollm.cli.bench_workload import check_workload, kv_itemsize, workload_requests


@dataclass
class OurRuns:
    setting: dict
    results: dict  # by run name, in the order they ran
    requests: list = field(default_factory=list)
    threads: int = 0
    hf_dir: Path | None = None
    kv_gib: int = 1  # KV space that holds the workload's largest batch in fp32 (for the peer)


def turbollm_runs(ns: argparse.Namespace, args, ceilings, backend: str) -> OurRuns:
    import torch

    from turbollm.benchmarks import throughput, vllm_backend as vb
    from turbollm.benchmarks.datasets import fit_to_context, length_summary
    from turbollm.benchmarks.physics import physics_of_turbollm
    from turbollm.benchmarks.report import engine_setting, machine_setting, model_setting, print_block
    from turbollm.entrypoints.llm import LLM
    from turbollm.hub.resolve import CheckpointFormat, resolve_model

    check_workload(ns)
    resolved = resolve_model(ns.model)
    hf_dir, converted = vb.hf_fp32_folder(resolved)
    folder = replace(args, model=str(hf_dir), quantization="none")
    runs = [("turbollm_fp32", replace(folder, dtype="float32"))]
    if args.dtype != "float32":  # the folder's dense weights in bfloat16 too (--dtype)
        runs.append((f"turbollm_{args.dtype}", folder))
    if resolved.format is CheckpointFormat.GGUF or args.quantization not in (None, "none"):
        runs.append(("turbollm_default", args))
    source = str(resolved.path) if converted or hf_dir != resolved.path else "itself"
    out = OurRuns({"benchmark": "throughput", "backend": backend, "machine": machine_setting(ceilings),
                   "hf_fp32_folder": {"path": str(hf_dir), "converted_now": converted, "from": source}},
                  {}, hf_dir=hf_dir)
    for key, run_args in runs:
        llm = LLM(**asdict(run_args))
        engine = llm.engine
        phys = physics_of_turbollm(engine.footprint, engine.config, kv_itemsize(engine))
        if not out.requests:
            out.requests, cut = fit_to_context(workload_requests(ns, llm.get_tokenizer()), engine.max_model_len)
            out.threads = torch.get_num_threads()
            kv_bytes = 2 * engine.config.num_layers * engine.config.num_kv_heads * engine.config.head_dim * 4
            out.kv_gib = vb.kv_space_gib(out.requests, ns.max_num_seqs, kv_bytes)
            out.setting["workload"] = {"dataset": ns.dataset, **length_summary(out.requests),
                                       "prompts_cut_to_fit_context": cut,
                                       **({"input_len": ns.input_len, "prompt_seed": ns.prompt_seed}
                                          if ns.dataset == "random" else {"max_input_len": ns.max_input_len}),
                                       "sampling": "greedy, ignore_eos: every request yields exactly output_len tokens",
                                       "warmup": "none" if ns.no_warmup else "one tiny untimed request per run"}
            out.setting["threads"] = out.threads
            print_block("setting", {"model": ns.model, "threads": out.threads, "machine": out.setting["machine"],
                                    "workload": out.setting["workload"]})
        out.setting[key] = {"model": model_setting(engine.resolved, engine.config, phys),
                            "engine_args": engine_setting(run_args)}
        print_block(f"setting: {key}", {"model": str(engine.resolved.path),
                                        "weights_dtype": out.setting[key]["model"]["weights_dtype"],
                                        "kv_cache_dtype": str(getattr(engine.kv_config, "dtype", "?"))})
        out.results[key] = throughput.run_turbollm_throughput(llm, out.requests, phys, ceilings,
                                                              warmup=not ns.no_warmup, use_tqdm=ns.progress)
        print_block(key, out.results[key])
        del llm, engine
        gc.collect()
    return out
