"""Command-line flags for engine arguments, named after EngineArgs fields (`--max-num-seqs`)."""

from __future__ import annotations

import argparse

from turbollm.cli.config_file import add_config_flags
from turbollm.engine_args import DENSE_DTYPES, KV_CACHE_DTYPES, QMATMUL_PATHS, EngineArgs
from turbollm.kernels.forms import FORMS


class QuantizationFlag(argparse._StoreAction):
    """`--quantization`: its help lists the registered linear methods, looked up only when help is
    printed (building the parser must not import torch)."""

    @property
    def help(self) -> str:
        from turbollm.quantization import LINEAR_METHODS

        return (f"weight storage and matmul method, one of: {', '.join(sorted(LINEAR_METHODS))} (default: 'gguf' "
                f"for a GGUF file, whose weights stay in their own block types; 'none', float32, otherwise)")

    @help.setter
    def help(self, value) -> None:  # argparse assigns the help given to add_argument; ours is computed
        pass


def add_engine_flags(p: argparse.ArgumentParser, model_required: bool = False, speculative: bool = True,
                     several: tuple[str, ...] = ()) -> None:
    """The engine flags on `p`; those named in `several` (dests) take one or more values (a benchmark
    that runs each), default None."""
    def multi(dest: str, default):
        return {"nargs": "+", "default": None} if dest in several else {"default": default}

    p.add_argument("--model", "-m", default=None if model_required else "smollm2-135m", required=model_required,
                   help="catalog name, GGUF file, HF folder or hub id (default: smollm2-135m)")
    p.add_argument("--quantization", default=None, action=QuantizationFlag)
    p.add_argument("--dtype", **multi("dtype", "float32"), choices=list(DENSE_DTYPES),
                   help="dense weights (an HF folder or --quantization none, dense vocabulary tables): float32 "
                        "(default; the exact reference), bfloat16 (half the bytes; many-row products through "
                        "oneDNN's bf16 kernels, AMX where the CPU has it; norms and attention stay float32) or "
                        "auto (bfloat16 on a CPU with AVX512_BF16 / AMX-BF16, float32 elsewhere); quantized "
                        "weights are unaffected")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16; 32 for int8/int4 K/V)")
    p.add_argument("--kv-cache-memory", type=float, default=None, help="KV-cache budget in GiB")
    p.add_argument("--kv-cache-dtype", **multi("kv_cache_dtype", "auto"), choices=list(KV_CACHE_DTYPES),
                   help="K/V storage: float32, or float16 (half the bytes attention reads; values rounded to "
                        "fp16); auto (default): float16 for quantized weights (GGUF block types, --quantization "
                        "int8/int4/int3, GPTQ/AWQ folders), as llama.cpp, and for --dtype bfloat16, float32 for the fp32 "
                        "reference; int8 / "
                        "int4: quantized blocks (K per channel, V per token, float16 scales) with the newest "
                        "--kv-recent-window tokens in float16")
    p.add_argument("--kv-recent-window", type=int, default=None,
                   help="with --kv-cache-dtype int8/int4: the newest tokens of each sequence kept in float16 "
                        "(default 128)")
    p.add_argument("--kv-policy", **multi("kv_policy", "auto"),
                   help="which K/V each layer keeps: auto (default; sliding-window layers such as Gemma 3's release "
                        "the blocks their window has passed), dense (every layer keeps every block), streaming "
                        "(attention sinks + a window, StreamingLLM: flat memory at any length, past the trained "
                        "context; needs --kv-window), h2o / snapkv (attention-score eviction: each sequence keeps "
                        "--kv-budget tokens, its least-attended blocks evicted)")
    p.add_argument("--attention-sinks", type=int, default=None,
                   help="with --kv-policy streaming: the first tokens every layer keeps (default 4; 0: window only)")
    p.add_argument("--kv-window", type=int, default=None,
                   help="with --kv-policy streaming: the most recent tokens every layer keeps")
    p.add_argument("--kv-budget", type=int, default=None,
                   help="with --kv-policy h2o / snapkv: the tokens of K/V each sequence keeps")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of shared prompt prefixes (default: on)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step through the PyTorch modules (default: decode steps run all layers in "
                        "one C++ call with the same kernels and the same results)")
    p.add_argument("--qmatmul", default=None, choices=list(QMATMUL_PATHS),
                   help="quantized-matmul numerics: auto (default; avx2 form: 16-bit activations for small batches, "
                        "dequantize + fp32 sgemm for large; repacked forms: two int8 levels at every size), "
                        "fast (llama.cpp's one int8 level: faster, KL ~1e-3-4e-3), or one path for every batch "
                        "size (q8, q8x2, q16, dequant)")
    p.add_argument("--kernel-form", default=None, choices=list(FORMS),
                   help="CPU kernel form: avx2, avx512_vnni (GGML weights repacked at load into interleaved rows, "
                        "one integer tile kernel for every batch size), avx2_tiles (the same layout and results on "
                        "AVX2) or amx (whole tiles of 16 rows on AMX); default: $TURBOLLM_KERNEL_FORM, else "
                        "avx512_vnni where the CPU has it, else avx2")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="tensor parallelism: N worker processes on this host, each with 1/N of every weight and of "
                        "the KV heads, joined over gloo (the cores split between them)")
    p.add_argument("--tp-shared-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="tensor-parallel collectives through shared memory between the ranks (default: on; off: "
                        "gloo over loopback for every collective)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline parallelism: the layers cut into M stages (each --tensor-parallel-size processes "
                        "with its layers' weights and KV cache), hidden states sent between them")
    p.add_argument("--pp-layer-partition", default=None, metavar="N,N,...",
                   help="layers per pipeline stage (default: balanced by the parameters each stage multiplies "
                        "with, the LM head counted on the last)")
    p.add_argument("--pp-microbatches", type=int, default=None,
                   help="a step's sequences cut into this many micro-batches so the stages overlap (default: one "
                        "per stage), each of 64 tokens or more (a decode step of a few sequences stays whole)")
    p.add_argument("--pp-steps-in-flight", type=int, default=None,
                   help="steps handed to the pipeline before the oldest one's tokens are back, each with its share "
                        "of the sequences, so the stages overlap in decode too (default: one per stage; 1: a step "
                        "at a time, as ranks torchrun started always run)")
    p.add_argument("--distributed-executor-backend", default="uni", choices=["uni", "mp", "torchrun"],
                   help="uni (default): the model runs in this process; mp: in one worker process, the engine "
                        "sending each step to it as plain data (chosen for you with -tp or -pp > 1); torchrun: "
                        "ranks torchrun started, on one host or several (chosen for you under torchrun)")
    if speculative:  # (`bench spec` takes several)
        p.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="speculative decoding, vLLM's names: '{\"method\": \"ngram\" | \"suffix\" | \"draft_model\", "
                            "\"num_speculative_tokens\": K, ...}' (K adapts per step unless \"adaptive\": false)")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help="a KV connector, vLLM's names: '{\"kv_connector\": \"store\", \"kv_role\": \"kv_both\" | "
                        "\"kv_producer\" | \"kv_consumer\", \"kv_store_path\": DIR, \"kv_store_max_bytes\": N, "
                        "\"kv_store_ram_bytes\": N}' (the store: prefix blocks kept in files that outlive the process)")
    p.add_argument("--kv-store-path", default=None, metavar="DIR",
                   help="keep prefix KV blocks in this folder (the store connector, role kv_both): a later run, or "
                        "another instance naming the same folder, loads a prompt's cached prefix instead of "
                        "computing it; size cap 8 GiB (least recently used deleted), see --kv-transfer-config")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    add_config_flags(p)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=ns.model, quantization=ns.quantization, dtype=ns.dtype, max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        block_size=ns.block_size,
        kv_cache_memory=int(ns.kv_cache_memory * (1 << 30)) if ns.kv_cache_memory else None,
        seed=ns.seed, threads=ns.threads, enable_prefix_caching=ns.enable_prefix_caching,
        kv_cache_dtype=ns.kv_cache_dtype, kv_policy=getattr(ns, "kv_policy", "auto"), enforce_eager=ns.enforce_eager,
        attention_sinks=ns.attention_sinks, kv_window=ns.kv_window, kv_recent_window=ns.kv_recent_window,
        kv_budget=ns.kv_budget,
        distributed_executor_backend=ns.distributed_executor_backend, qmatmul=ns.qmatmul,
        kernel_form=ns.kernel_form, tensor_parallel_size=ns.tensor_parallel_size, tp_shared_memory=ns.tp_shared_memory,
        pipeline_parallel_size=ns.pipeline_parallel_size, pp_layer_partition=ns.pp_layer_partition,
        pp_microbatches=ns.pp_microbatches, pp_steps_in_flight=ns.pp_steps_in_flight,
        speculative_config=getattr(ns, "speculative_config", None),
        kv_transfer_config=ns.kv_transfer_config, kv_store_path=ns.kv_store_path)
