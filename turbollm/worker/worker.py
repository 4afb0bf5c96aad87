"""A worker: one model replica with its model runner, KV storage and device (the CPU here).

The executor owns the workers; the engine never sees them. A worker loads its model (or takes
one already loaded, in the engine's process), allocates the paged K/V storage the engine's
`KVCacheConfig` describes (each layer's `LayerKVCache`, by its group's spec), and runs steps:
`SchedulerOutput` in, `ModelRunnerOutput` out. With speculative decoding the worker that gives the
step's output also drafts (`Drafter`, worker/drafter.py: the proposer, and a draft model's own runner
with the K/V `draft_kv_config` describes) after each step. Each tensor- or pipeline-parallel rank is one.
"""

from __future__ import annotations

import os
import time

import torch

from turbollm.attention import get_attention_backend
from turbollm.engine_config import WorkerConfig
from turbollm.handoff.kv_cache_spec import KVCacheConfig
from turbollm.handoff.runner_output import ModelRunnerOutput
from turbollm.handoff.scheduler_output import SchedulerOutput
from turbollm.kernels.forms import resolve_form
from turbollm.models.forward_batch import LayerHooks
from turbollm.quantization.base import set_kernel_form, set_qmatmul
from turbollm.quantization.dense_dtype import resolve_dtype, set_dtype
from turbollm.worker.drafter import Drafter
from turbollm.worker.kv_allocation import allocate_kv_storage, allocate_shared_kv_storage
from turbollm.worker.kv_connector import connector_shares_pool, make_worker_connector
from turbollm.worker.malloc_tuning import release_heap, tune_malloc
from turbollm.worker.model_runner import ModelRunner


class Worker:
    """`config`: the engine's groups a worker reads (model, cache, parallel, speculative; engine_config.py).
    `rank` / `init_method`: with tensor_parallel_size N × pipeline_parallel_size M > 1, this worker is
    rank `rank` of N × M joined at `init_method` (distributed/tensor_parallel.py): it keeps its shard of
    the weights and of the KV heads of its stage's layers (distributed/pipeline_parallel.py); `sampler_seed` is the seed every rank's sampler shares (so their draws stay in step);
    `shm_files`: the shared-memory exchange of ranks on one host (distributed/shm_comm.py)."""

    def __init__(self, config: WorkerConfig, kv_config: KVCacheConfig, loaded=None, rank: int = 0,
                 init_method: str | None = None, sampler_seed: int | None = None, shm_files=None,
                 draft_kv_config: KVCacheConfig | None = None):
        from turbollm.loader import load_model

        tune_malloc()  # per process: the worker's forward passes are what it is for
        model, par = config.model, config.parallel
        tp, world = par.tensor_parallel_size, par.world_size
        threads = model.threads or (torch.get_num_threads() if world > 1 else None)  # ranks split the cores
        if threads:  # (of this host: under torchrun, the ranks torchrun started here)
            torch.set_num_threads(max(1, threads // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        hooks, layers = None, None
        if world > 1:
            from turbollm.distributed.tensor_parallel import all_reduce_hook, init_parallel

            if par.pipeline_parallel_size > 1:  # this rank's stage: its range of layers
                stage, counts = rank // tp, par.pp_layer_partition
                layers = range(sum(counts[:stage]), sum(counts[:stage + 1]))
            init_parallel(rank, tp, init_method, shm_files, par.pipeline_parallel_size, layers)
            if tp > 1:
                hooks = LayerHooks(attn_out=all_reduce_hook, mlp_out=all_reduce_hook)  # row-parallel partial sums
        self.rank = rank
        self.loaded = loaded or load_model(model.model, quantization=model.quantization)
        set_qmatmul(self.loaded.model, model.qmatmul)  # this engine's numerics, on its model only
        set_kernel_form(self.loaded.model, resolve_form(model.kernel_form))  # and its kernels' weight layout
        set_dtype(self.loaded.model, resolve_dtype(model.dtype, self.loaded.model))  # dense weights: fp32 or bf16
        block_size = config.cache.block_size
        # a prefill instance's p2p connector wants its pool in shared memory (decode instances copy from it)
        arena = None
        if connector_shares_pool(config.kv_transfer):
            kv_caches, arena = allocate_shared_kv_storage(kv_config, layers)
        else:
            kv_caches = allocate_kv_storage(kv_config, layers)
        self.runner = ModelRunner(self.loaded.model, kv_caches, block_size,
                                  get_attention_backend(model.attention_backend), fused_decode=not model.enforce_eager,
                                  seed=model.seed if sampler_seed is None else sampler_seed, hooks=hooks,
                                  layer_groups=kv_config.layer_groups, group_attention=kv_config.group_attention,
                                  score_rows=kv_config.score_rows, layers=layers,
                                  microbatches=par.pp_microbatches or par.pipeline_parallel_size)
        # a KV connector (worker/kv_connector.py): its loads and saves before each step's forward pass
        self.kv_connector = make_worker_connector(config.kv_transfer, self.runner.kv_caches, self.runner.layer_groups,
                                                  kv_config, self.runner, arena)
        # the rank whose output the executors return (the first of the last stage) drafts for the next step
        self.drafter = None
        if config.speculative is not None and rank == par.output_rank:
            # (with several ranks on this host the others wait while this one drafts: it takes their cores too)
            self.drafter = Drafter.build(config.speculative, model, self.runner.states, block_size, draft_kv_config,
                                         threads if world > 1 else None)
        release_heap()  # what loading freed goes back to the OS (worker/malloc_tuning.py)

    def close(self) -> None:
        """Finish what must outlive the worker (a KV connector's writes)."""
        if self.kv_connector is not None:
            self.kv_connector.close()

    def footprint(self):
        """What the loaded model holds (plain data, for the engine and the benchmarks)."""
        from turbollm.loader.footprint import model_footprint

        return model_footprint(self.loaded)

    def comm_stats(self) -> dict:
        """This rank's time, calls and bytes in collectives so far (all zero without tensor parallelism)."""
        from turbollm.distributed.tensor_parallel import comm_stats

        return comm_stats()

    def fused_steps(self) -> int:
        """Steps this worker ran through the fused C++ step (0 when it has none)."""
        return self.runner.fused.steps if self.runner.fused is not None else 0

    def queued(self, sched: SchedulerOutput) -> None:
        """Step `sched` has reached this worker (called from its reader thread, before the step runs): a
        pipeline stage may start on it (`PipelineStage.queued`)."""
        if self.runner.pipeline is not None:
            self.runner.pipeline.queued(sched)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        moved = self.kv_connector.execute(sched.kv_transfer) if self.kv_connector and sched.kv_transfer else None
        if self.drafter is not None:
            self.drafter.before_step(sched, self.runner.states)
        out = self.runner.execute_model(sched)
        if moved is not None:
            out.kv_loaded, out.kv_waiting, out.kv_stats = moved
        if self.drafter is not None:
            self.drafter.after_step(sched, out, self.runner.states)
        out.worker_seconds = time.perf_counter() - t0
        return out
