"""EngineArgs: every knob of the engine, with vLLM's names and CPU-sensible defaults, flat as users give them;
`engine_config()` groups them (engine_config.py), which also checks each group and the pairs of techniques."""

from __future__ import annotations

from dataclasses import dataclass, fields

from turbollm.engine_config import DENSE_DTYPES, QMATMUL_PATHS  # noqa: F401 - the CLI reads the names here
from turbollm.engine_config import (DEFAULT_RECENT_WINDOW, KV_CACHE_DTYPES, QUANTIZED_KV, CacheArgs, EngineConfig,
                                    ModelArgs, ParallelArgs, SchedulerArgs)
from turbollm.errors import InvalidRequestError
from turbollm.handoff.kv_transfer import parse_kv_transfer_config
from turbollm.procfs import available_memory
from turbollm.spec_decode.config import parse_speculative_config

GiB = 1 << 30


# What "auto" means: a model whose linear weights are quantized (GGUF block types, the int8 /
# int4 / int3 layouts, GPTQ and AWQ folders) runs with llama.cpp's default float16 cache (KL
# against fp32 K/V: 5e-7 to 3e-6 nats/token measured, docs/BENCHMARKS.md); the fp32 reference
# (linear method "none", or none named, as `eval ppl` measures the weights alone) keeps float32, and
# dense weights in bfloat16 (`dtype`) take float16 K/V, the cache of a 16-bit compute dtype as vLLM's.
AUTO_KV_DTYPE_QUANTIZED = "float16"


def kv_cache_torch_dtype(name: str, quantization: str | None = None, dtype: str = "float32"):
    """The torch dtype of kv_cache_dtype `name` (a key of KV_CACHE_DTYPES) for a model loaded with
    linear method `quantization` and dense dtype `dtype` (which only "auto" depends on)."""
    import torch

    if name == "auto" and ((quantization or "none") != "none" or dense_bfloat16(dtype)):
        return getattr(torch, AUTO_KV_DTYPE_QUANTIZED)
    return getattr(torch, KV_CACHE_DTYPES[name])


def dense_bfloat16(dtype: str) -> bool:
    """Whether dense weights run in bfloat16 under `dtype` (its "auto": on a CPU with bfloat16 instructions; the
    model's weights are not known here, and a quantized model's K/V is float16 either way)."""
    from turbollm.kernels.dtypes import dense_dtype_name

    return dense_dtype_name(dtype) == "bfloat16"


@dataclass
class EngineArgs:
    model: str = "smollm2-135m"
    quantization: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int | None = None  # tokens per KV block; default 16, 32 for int8/int4 K/V (their scales cost less)
    kv_cache_memory: int | None = None  # bytes, all ranks together; default: a quarter of available RAM, at most 4 GiB
    enable_prefix_caching: bool = True
    seed: int | None = None
    attention_backend: str = "cpu"  # "cpu": C++ decode kernel when it builds; "torch": pure PyTorch
    threads: int | None = None  # torch threads; default: torch's own (all cores)
    # the dense weights' dtype (quantization/dense_dtype.py): "float32" (the exact reference), "bfloat16"
    # (half the bytes; oneDNN's bf16 products for many rows), "auto" (bfloat16 on a CPU with AVX512_BF16 /
    # AMX-BF16 for a model with dense linear weights, float32 otherwise)
    dtype: str = "float32"
    # K/V storage: "float16" halves the bytes decode attention reads per token (values rounded to
    # fp16 when stored); "auto": float16 for a GGUF model in its own block types (llama.cpp's
    # default), float32 (the compute dtype) otherwise
    kv_cache_dtype: str = "auto"
    # int8 / int4 K/V: the newest tokens of each sequence kept in float16 (default 128), quantized as
    # they age out
    kv_recent_window: int | None = None
    # which K/V each layer keeps (turbollm/core/kv_policy.py): "auto" (sliding-window layers release
    # the blocks their window passed) or "dense" (every layer keeps every block)
    kv_policy: str = "auto"
    # kv_policy "streaming": the first attention_sinks tokens (default 4; 0: window only) and the last
    # kv_window tokens each layer keeps (sequences may then run past the model's trained context)
    attention_sinks: int | None = None
    kv_window: int | None = None
    # kv_policy "h2o" / "snapkv": the tokens of K/V each sequence keeps (its least-attended blocks evicted)
    kv_budget: int | None = None
    # True: every step runs the layers as PyTorch modules; False: decode steps and steps of a few
    # tokens run all layers in one C++ call with the same kernels (worker/fused_step.py; same
    # results, less Python)
    enforce_eager: bool = False
    # quantized-matmul numerics (turbollm.kernels.quant): "auto" (None: the default; avx2 form: q16 for
    # small batches, dequantize + sgemm above; repacked forms: q8x2 at every size), "fast" (llama.cpp's
    # one q8 level), or one path forced for every batch size ("q8", "q8x2", "q16", "dequant"). Applied to
    # this engine's model only.
    qmatmul: str | None = None
    # the CPU kernel form (turbollm.kernels.forms): "avx2", "avx512_vnni" (GGML weights repacked into
    # interleaved rows, one tile kernel for any batch size), "avx2_tiles" (that layout on AVX2) or "amx" (the
    # same, tiles of 16 rows on AMX);
    # None: $TURBOLLM_KERNEL_FORM, else avx512_vnni where the CPU has it, else avx2. This engine's model only.
    kernel_form: str | None = None
    # how the engine reaches its worker: "uni" (in this process) or "mp" (one worker process that
    # loads the model; plain data crosses the process boundary each step)
    distributed_executor_backend: str = "uni"
    # tensor parallelism (distributed/tensor_parallel.py): N worker processes on this host, each with
    # its shard of every weight and of the KV heads, joined over gloo; needs the "mp" executor (chosen
    # for you when N > 1), the cores split between the ranks
    tensor_parallel_size: int = 1
    # tensor-parallel collectives through shared memory (ranks on one host; gloo over loopback otherwise,
    # and for tensors larger than a slot)
    tp_shared_memory: bool = True
    # pipeline parallelism (distributed/pipeline_parallel.py): the layers cut into M stages, each a group
    # of tensor_parallel_size processes with its layers' weights and KV cache; hidden states sent between
    # stages. pp_layer_partition: layers per stage ("12,12"; None: balanced by parameters);
    # pp_microbatches: a step's sequences cut into this many micro-batches so the stages overlap
    # (None: one per stage), each of 64 tokens or more (distributed/pipeline_parallel.MIN_MICROBATCH_TOKENS);
    # pp_steps_in_flight: steps handed out before the oldest one's tokens are back, each with its share of
    # the sequences, so that the stages overlap in decode too (None: one per stage; 1: a step at a time)
    pipeline_parallel_size: int = 1
    pp_layer_partition: object = None
    pp_microbatches: int | None = None
    pp_steps_in_flight: int | None = None
    # speculative decoding (turbollm/spec_decode): vLLM's speculative_config, a dict or its JSON text;
    # parsed into a SpeculativeConfig here (every bad field named before anything loads): "ngram",
    # "suffix" or "draft_model" (a draft model is checked against the target by the engine, unloaded)
    speculative_config: object = None
    # a KV connector (handoff/kv_transfer.py), vLLM's kv_transfer_config: a dict or its JSON text, e.g.
    # {"kv_connector": "store", "kv_role": "kv_both", "kv_store_path": "/var/kv"}; kv_store_path alone means
    # that store (prefix blocks kept in files that outlive the process, shared by the instances that name them)
    kv_transfer_config: object = None
    kv_store_path: str | None = None

    def __post_init__(self) -> None:
        """Fill the defaults that depend on other arguments, then check every group and every pair of
        techniques (engine_config.py) before anything loads."""
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype {self.kv_cache_dtype!r}: choose one of "
                                      f"{', '.join(KV_CACHE_DTYPES)}")
        if self.block_size is None:
            self.block_size = 32 if self.kv_cache_dtype in QUANTIZED_KV else 16
        from turbollm.distributed.launch import torchrun_rank
        from turbollm.distributed.pipeline_parallel import parse_partition

        self.pp_layer_partition = parse_partition(self.pp_layer_partition)
        if self.world_size > 1:  # one process per rank: spawned here, or started by torchrun
            self.distributed_executor_backend = "torchrun" if torchrun_rank() is not None else "mp"
        elif self.distributed_executor_backend == "torchrun":
            raise InvalidRequestError("distributed_executor_backend 'torchrun' takes ranks torchrun started: run under "
                                      "torchrun with tensor_parallel_size x pipeline_parallel_size > 1")
        self.speculative_config = parse_speculative_config(self.speculative_config)
        self.kv_transfer_config = parse_kv_transfer_config(self.kv_transfer_config, self.kv_store_path)
        if self.kv_cache_dtype in QUANTIZED_KV and self.kv_recent_window is None:
            self.kv_recent_window = DEFAULT_RECENT_WINDOW
        self.engine_config().check()
        spec = self.speculative_config
        k = spec.num_speculative_tokens if spec is not None else 0
        if self.kv_cache_dtype in QUANTIZED_KV and self.kv_recent_window <= k:
            raise InvalidRequestError(f"kv_recent_window must be more than num_speculative_tokens ({k}), "
                                      f"got {self.kv_recent_window}")

    def engine_config(self) -> EngineConfig:
        """These arguments in their groups (engine_config.py)."""
        return EngineConfig(
            ModelArgs(self.model, self.quantization, self.dtype, self.max_model_len, self.seed, self.threads,
                      self.attention_backend, self.enforce_eager, self.qmatmul, self.kernel_form),
            CacheArgs(self.block_size, self.kv_cache_memory, self.kv_cache_dtype, self.kv_recent_window,
                      self.enable_prefix_caching, self.kv_policy, self.attention_sinks, self.kv_window, self.kv_budget),
            ParallelArgs(self.distributed_executor_backend, self.tensor_parallel_size, self.tp_shared_memory,
                         self.pipeline_parallel_size,
                         tuple(self.pp_layer_partition) if self.pp_layer_partition is not None else None,
                         self.pp_microbatches, self.pp_steps_in_flight),
            self.speculative_config, self.kv_transfer_config,
            SchedulerArgs(self.max_num_seqs, self.max_num_batched_tokens))

    @property
    def world_size(self) -> int:
        """Worker processes: tensor_parallel_size × pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def kv_policy_config(self):
        """The KV policy with its options (`core/kv_policy.KVPolicyConfig`)."""
        from turbollm.core.kv_policy import KVPolicyConfig

        return KVPolicyConfig(self.kv_policy, self.attention_sinks, self.kv_window, self.kv_budget)

    def kv_torch_dtype(self, quantization: str | None = None):
        """The K/V storage dtype for a model loaded with linear method `quantization` (and this `dtype`)."""
        return kv_cache_torch_dtype(self.kv_cache_dtype, quantization, self.dtype)

    def kv_cache_bytes(self) -> int:
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory)
        return int(min(4 * GiB, available_memory(8 * GiB) // 4))

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(model=model, **kwargs)
