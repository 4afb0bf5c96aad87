"""The engine's arguments in groups, each checking itself, and the techniques that do not combine, in one table.

`EngineArgs` (engine_args.py) is the flat, user-facing form (vLLM's names: `LLM(model, **kwargs)`, the CLI's
flags, a config file's keys). `EngineArgs.engine_config()` groups it as vLLM's `VllmConfig` does:

- `ModelArgs`: which weights and how they are computed (quantization, matmul path, kernel form, threads, seed);
- `CacheArgs`: the paged K/V (block size, budget, storage format, KV policy and its options, prefix caching);
- `ParallelArgs`: how the engine reaches its workers (executor, tensor and pipeline parallelism);
- `SchedulerArgs`: what a step may hold (sequences, tokens);
- `SpeculativeConfig` (spec_decode/config.py): speculative decoding, or None;
- `KVTransferConfig` (handoff/kv_transfer.py): a KV connector (the block store), or None.

Each group checks its own fields (`check`). What no group can see alone, two techniques that do not work
together, is `REFUSALS`: pairs of `TECHNIQUES` (a name and a test of the config) with the reason each pair is
refused; `check_combinations` raises the first that applies, naming both. tests/test_engine_config.py walks
every pair of techniques: either the pair is in the table or an engine runs with both.

The workers read only what they use (`WorkerConfig`: model, cache, parallel, speculative, KV transfer; the scheduler's
limits stay with the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from turbollm.errors import InvalidRequestError
from turbollm.handoff.kv_transfer import KVTransferConfig
from turbollm.kernels.dtypes import DENSE_DTYPES  # noqa: F401 - the dense dtypes' names (engine_args, the CLI)
from turbollm.spec_decode.config import SpeculativeConfig

# kv_cache_dtype names -> the torch dtype (by name: this module stays import-light for the CLI)
# of the paged K/V storage; "auto" depends on the weights (AUTO_KV_DTYPE_QUANTIZED)
KV_CACHE_DTYPES: dict[str, str] = {
    "auto": "float32",
    "float32": "float32",
    "float16": "float16",
    "fp16": "float16",
    # quantized (attention/kv_storage.py): int8, or int4 packed two a byte (stored as uint8), with
    # float16 scales; the newest kv_recent_window tokens of each sequence stay in float16
    "int8": "int8",
    "int4": "uint8",
}
QUANTIZED_KV = ("int8", "int4")
DEFAULT_RECENT_WINDOW = 128  # tokens kept in float16 by a quantized K/V format

# the quantized-matmul paths of turbollm.kernels.quant (by name: this module stays import-light)
QMATMUL_PATHS = ("auto", "fast", "q8", "q8x2", "q16", "dequant")


@dataclass(frozen=True)
class ModelArgs:
    model: str
    quantization: str | None = None
    dtype: str = "float32"
    max_model_len: int | None = None
    seed: int | None = None
    threads: int | None = None
    attention_backend: str = "cpu"
    enforce_eager: bool = False
    qmatmul: str | None = None
    kernel_form: str | None = None

    def check(self) -> None:
        from turbollm.kernels.dtypes import check_dtype
        from turbollm.kernels.forms import check_form

        check_dtype(self.dtype)
        check_form(self.kernel_form)
        if self.qmatmul is not None and self.qmatmul not in QMATMUL_PATHS:
            raise InvalidRequestError(f"qmatmul {self.qmatmul!r}: choose one of {', '.join(QMATMUL_PATHS)}")


@dataclass(frozen=True)
class CacheArgs:
    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"
    kv_recent_window: int | None = None
    enable_prefix_caching: bool = True
    kv_policy: str = "auto"
    attention_sinks: int | None = None
    kv_window: int | None = None
    kv_budget: int | None = None

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype in QUANTIZED_KV

    def check(self) -> None:
        from turbollm.core.kv_policy import KVPolicyConfig, check_kv_policy

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype {self.kv_cache_dtype!r}: choose one of "
                                      f"{', '.join(KV_CACHE_DTYPES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_recent_window is not None and not self.quantized:
            raise InvalidRequestError(f"kv_recent_window applies to kv_cache_dtype int8 or int4, not "
                                      f"{self.kv_cache_dtype!r}")
        if self.kv_recent_window is not None and self.kv_recent_window < 0:
            raise InvalidRequestError(f"kv_recent_window must be >= 0, got {self.kv_recent_window}")
        check_kv_policy(KVPolicyConfig(self.kv_policy, self.attention_sinks, self.kv_window, self.kv_budget),
                        self.block_size)  # unknown names, stray or bad options


@dataclass(frozen=True)
class ParallelArgs:
    distributed_executor_backend: str = "uni"
    tensor_parallel_size: int = 1
    tp_shared_memory: bool = True
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    pp_microbatches: int | None = None
    pp_steps_in_flight: int | None = None

    @property
    def world_size(self) -> int:
        """Worker processes: tensor_parallel_size × pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose output a step returns: the first of the last pipeline stage (it also drafts)."""
        return self.world_size - self.tensor_parallel_size

    def check(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("pp_microbatches", "pp_steps_in_flight"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pp_steps_in_flight is not None and self.pipeline_parallel_size == 1:
            raise InvalidRequestError("pp_steps_in_flight takes pipeline stages (pipeline_parallel_size > 1)")
        if self.pp_layer_partition is not None and len(self.pp_layer_partition) != self.pipeline_parallel_size:
            raise InvalidRequestError(f"pp_layer_partition gives {len(self.pp_layer_partition)} stages, "
                                      f"pipeline_parallel_size is {self.pipeline_parallel_size}")
        if self.distributed_executor_backend not in ("uni", "mp", "torchrun"):
            raise InvalidRequestError(f"distributed_executor_backend {self.distributed_executor_backend!r}: choose "
                                      "'uni' (the worker in this process), 'mp' (worker processes) or 'torchrun' "
                                      "(ranks torchrun started)")


@dataclass(frozen=True)
class SchedulerArgs:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def check(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker reads: its model, its K/V, its place among the ranks, and speculation (it drafts)."""

    model: ModelArgs
    cache: CacheArgs
    parallel: ParallelArgs
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None


@dataclass(frozen=True)
class EngineConfig(WorkerConfig):
    scheduler: SchedulerArgs = SchedulerArgs()

    def for_workers(self) -> WorkerConfig:
        return WorkerConfig(self.model, self.cache, self.parallel, self.speculative, self.kv_transfer)

    def check(self) -> None:
        for group in (self.model, self.cache, self.parallel, self.scheduler):
            group.check()
        check_combinations(self)


def _spec_method(c: EngineConfig) -> str | None:
    return c.speculative.method if c.speculative is not None else None


def _connector(c: EngineConfig) -> str | None:
    return c.kv_transfer.kv_connector if c.kv_transfer is not None else None


def _evicts(c: EngineConfig) -> bool:
    from turbollm.core.kv_policy import get_kv_policy

    return get_kv_policy(c.cache.kv_policy).evicts


#: techniques a config may switch on, each a test of the config (the names the refusals give)
TECHNIQUES: dict[str, Callable[[EngineConfig], bool]] = {
    "quantized K/V (kv_cache_dtype int8 / int4)": lambda c: c.cache.quantized,
    "kv_policy 'streaming'": lambda c: c.cache.kv_policy == "streaming",
    "an evicting kv_policy (h2o, snapkv)": _evicts,
    "speculative decoding": lambda c: c.speculative is not None,
    "a draft model": lambda c: _spec_method(c) == "draft_model",
    "pipeline parallelism (pipeline_parallel_size > 1)": lambda c: c.parallel.pipeline_parallel_size > 1,
    "tensor or pipeline parallelism": lambda c: c.parallel.world_size > 1,
    "quantization 'int8'": lambda c: c.model.quantization == "int8",
    "a KV connector (kv_transfer_config, kv_store_path)": lambda c: c.kv_transfer is not None,
    "the block store (kv_connector 'store')": lambda c: _connector(c) == "store",
    "no prefix caching": lambda c: not c.cache.enable_prefix_caching,
}


@dataclass(frozen=True)
class Refusal:
    first: str  # a TECHNIQUES name
    second: str
    reason: str


#: the pairs of techniques that do not run together, and why (every other pair does: tests/test_engine_config.py)
REFUSALS: tuple[Refusal, ...] = (
    Refusal("kv_policy 'streaming'", "a draft model",
            "the draft reads the target's block table, whose released blocks it would need; use method 'ngram' or "
            "'suffix'"),
    Refusal("kv_policy 'streaming'", "quantized K/V (kv_cache_dtype int8 / int4)",
            "its sinks are read in float16 or float32 K/V only"),
    Refusal("an evicting kv_policy (h2o, snapkv)", "speculative decoding",
            "verified drafts would vote in the attention scores"),
    Refusal("an evicting kv_policy (h2o, snapkv)", "quantized K/V (kv_cache_dtype int8 / int4)",
            "its scores are computed over float K/V"),
    Refusal("an evicting kv_policy (h2o, snapkv)", "pipeline parallelism (pipeline_parallel_size > 1)",
            "its attention scores would have to be summed over the stages"),
    Refusal("pipeline parallelism (pipeline_parallel_size > 1)", "speculative decoding",
            "not built yet: the drafts would ride the pipeline's steps in flight"),
    Refusal("tensor or pipeline parallelism", "quantization 'int8'",
            "its channel equalization runs a calibration pass that does not run sharded yet; use 'int8-rtn' (or int4)"),
    Refusal("the block store (kv_connector 'store')", "no prefix caching",
            "blocks are named by their prefix-cache keys"),
    Refusal("a KV connector (kv_transfer_config, kv_store_path)", "an evicting kv_policy (h2o, snapkv)",
            "an evicted table no longer lists a prompt's blocks by position"),
    Refusal("a KV connector (kv_transfer_config, kv_store_path)", "tensor or pipeline parallelism",
            "not built yet: each rank would move its own shard of every block"),
)


def check_combinations(config: EngineConfig) -> None:
    """Raise InvalidRequestError for the first pair of `REFUSALS` that `config` switches on."""
    for r in REFUSALS:
        if TECHNIQUES[r.first](config) and TECHNIQUES[r.second](config):
            raise InvalidRequestError(f"{r.first} does not take {r.second}: {r.reason}")
