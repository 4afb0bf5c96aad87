"""`turbollm bench throughput --backend openvino` and `bench latency --compare openvino`: OpenVINO GenAI as the
peer, in the same run.

OpenVINO GenAI runs in its own interpreter (`--openvino-python`) on IR folders optimum-intel exports from the HF
fp32 folder turbollm also runs (`benchmarks/openvino_backend.py`), one per `--openvino-weights` format (fp32,
int8, int4; OpenVINO's own defaults otherwise: bfloat16 inference precision on a CPU with AVX512_BF16 / AMX);
turbollm's runs are those of `--backend vllm` (`bench_peer_runs.py`). Each OpenVINO run's ratios are printed, and
the best of them.
"""

from __future__ import annotations

import argparse

from turbollm.errors import BenchmarkError


def add_openvino_flags(p: argparse.ArgumentParser, needed_by: str) -> None:
    p.add_argument("--openvino-python", metavar="PATH", default=None,
                   help=f"the python of a virtual environment holding OpenVINO GenAI (needed by {needed_by}): "
                        "pip install torch==2.13.0 openvino-genai==2026.4.1.0 'optimum-intel[openvino]'")
    p.add_argument("--openvino-weights", nargs="+", default=["int8"], metavar="F",
                   help="OpenVINO exports to run, each a weight format of optimum-intel: fp32, int8 (default), int4")


def _formats(ns: argparse.Namespace) -> list[str]:
    from turbollm.benchmarks import openvino_backend as ob

    formats = list(dict.fromkeys(ns.openvino_weights))
    for f in formats:
        if f not in ob.WEIGHT_FORMATS:
            raise BenchmarkError(f"--openvino-weights {f!r}: choose from {', '.join(ob.WEIGHT_FORMATS)}")
    return formats


def compare_latency(ns: argparse.Namespace, engine, ours: dict) -> dict:
    """The latency workload's very prompts through OpenVINO GenAI, one export per --openvino-weights format;
    printed and returned with the ratios turbollm ÷ each."""
    import torch

    from turbollm.benchmarks import openvino_backend as ob, vllm_backend as vb
    from turbollm.benchmarks.latency import latency_prompts, peer_ratios
    from turbollm.benchmarks.report import print_block

    python = ob.check_python(ns.openvino_python)
    formats = _formats(ns)
    # run_latency's own prompts, in its order
    prompts = latency_prompts(engine.tokenizer, ns.input_len, ns.warmup + ns.num_iters, ns.prompt_seed)
    threads = torch.get_num_threads()
    hf_dir, _ = vb.hf_fp32_folder(engine.resolved)
    out = {}
    for fmt in formats:
        ir, exported = ob.exported_folder(python, hf_dir, fmt)
        res = ob.run_openvino_latency(python, ir, prompts, ns.output_len, threads, warmup=ns.warmup)
        res.update(model=str(ir), exported_now=exported)
        print_block(f"OpenVINO GenAI, {fmt} export (same prompts and threads)", res)
        ratios = peer_ratios(ours, res)
        print_block(f"turbollm / OpenVINO {fmt}", ratios)
        out[f"openvino_{fmt}"] = {"results": res, "ratios": ratios}
    return out


def bench_openvino(ns: argparse.Namespace, args, ceilings) -> dict:
    from turbollm.benchmarks import openvino_backend as ob, vllm_backend as vb
    from turbollm.benchmarks.report import print_block, write_json
    from turbollm.cli.bench_peer_runs import turbollm_runs

    if ns.backend != "openvino":
        raise BenchmarkError("--openvino-python goes with --backend openvino")
    python = ob.check_python(ns.openvino_python)
    formats = _formats(ns)
    ours = turbollm_runs(ns, args, ceilings, "openvino")
    setting, results = ours.setting, ours.results
    mine = dict(results)  # our runs, before the peer's runs join them
    labels = []
    for fmt in formats:
        print(f"exporting {ours.hf_dir} to OpenVINO IR ({fmt} weights; cached) ...", flush=True)
        ir, exported = ob.exported_folder(python, ours.hf_dir, fmt)
        label = f"openvino_{fmt}"
        labels.append(label)
        setting[label] = {"python": str(python), "model": str(ir), "exported_now": exported,
                          "export": " ".join(ob.export_command(python, ours.hf_dir, fmt, ir)[1:]),
                          "max_num_seqs": ns.max_num_seqs, "max_num_batched_tokens": ns.max_num_batched_tokens,
                          "kv_cache_GB": ours.kv_gib}
        print_block(f"setting: {label}", setting[label])
        print("running OpenVINO GenAI in its interpreter (compile, warm-up, then the timed generate) ...", flush=True)
        results[label] = ob.run_openvino_throughput(python, ir, ours.requests, ours.threads, ns.max_num_seqs,
                                                    ns.max_num_batched_tokens, ours.kv_gib, warmup=not ns.no_warmup)
        print_block(label, results[label])
    results["comparison"] = {label: vb.ratios(results[label], mine, label) for label in labels}
    best = max(labels, key=lambda lb: results[lb]["output_tok_per_s"])
    results["comparison"]["best_peer"] = best
    print_block("turbollm / OpenVINO GenAI (same requests and threads; each export as configured)",
                results["comparison"])
    record = {"benchmark": "throughput", "setting": setting, "results": results}
    write_json(ns.json, record)
    return record
