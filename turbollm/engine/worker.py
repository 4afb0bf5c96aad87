"""A worker: one model replica with its model runner, KV storage and device (the CPU here).

The executor owns the workers; the engine never sees them. A worker loads its model (or takes
one already loaded, in the engine's process), allocates the paged K/V storage the engine's
`KVCacheConfig` describes (each layer's `LayerKVCache`, by its group's spec), and runs steps: `SchedulerOutput` in, `ModelRunnerOutput` out. It is
what a tensor- or pipeline-parallel rank and a remote KV producer will each be.
"""

from __future__ import annotations

import torch

from turbollm.attention import get_attention_backend
from turbollm.engine.engine_args import EngineArgs
from turbollm.engine.kv_cache_spec import KVCacheConfig, allocate_kv_storage
from turbollm.engine.malloc_tuning import tune_malloc
from turbollm.engine.model_runner import ModelRunner
from turbollm.engine.runner_output import ModelRunnerOutput
from turbollm.engine.scheduler_output import SchedulerOutput
from turbollm.quantization.base import set_qmatmul


class Worker:
    def __init__(self, args: EngineArgs, kv_config: KVCacheConfig, loaded=None):
        from turbollm.loader import load_model

        tune_malloc()  # per process: the worker's forward passes are what it is for
        if args.threads:
            torch.set_num_threads(args.threads)
        self.loaded = loaded or load_model(args.model, quantization=args.quantization)
        set_qmatmul(self.loaded.model, args.qmatmul)  # this engine's numerics, on its model only
        self.runner = ModelRunner(self.loaded.model, allocate_kv_storage(kv_config), args.block_size,
                                  get_attention_backend(args.attention_backend), fused_decode=not args.enforce_eager,
                                  seed=args.seed, layer_groups=kv_config.layer_groups,
                                  group_attention=kv_config.group_attention, recent_slots=kv_config.recent_slots,
                                  score_rows=kv_config.score_rows)

    def footprint(self):
        """What the loaded model holds (plain data, for the engine and the benchmarks)."""
        from turbollm.loader.footprint import model_footprint

        return model_footprint(self.loaded)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)
