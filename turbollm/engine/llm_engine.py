"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

`add_request` validates a request and queues its first sequence (an n > 1 request's siblings
fork off it at its first sample). `step()` is schedule → executor → update → outputs:

- `Scheduler.schedule()` picks the step's batch and describes it as plain data (`SchedulerOutput`);
- the `Executor` runs it on its workers (in this process, or in a worker process:
  `distributed_executor_backend`) and returns the sampled tokens (`ModelRunnerOutput`);
- `Scheduler.update_from_output()` advances the counters, indexes full blocks in the prefix cache,
  forks siblings and applies the token-level stop rules;
- the `OutputProcessor` detokenizes, finds stop strings and builds the `RequestOutput`s.

With pipeline stages the executor takes several steps at once (`max_steps_in_flight`): `step()` hands
out steps (each with about 1/P of the sequences, none of them in a step still in flight) until P are
out, then takes the oldest one's output, so that stage 0 runs step k + 1 while stage 1 finishes step k.

`abort` ends a request at once and returns its KV blocks.

Limits: `max_model_len` is capped at start-up to the tokens the KV pool holds (with a log
line), so one sequence always fits the pool alone and the scheduler always makes progress.
A failure that belongs to one request (its sampling, its stop checks, its detokenization, a
sequence the pool cannot hold) ends that request only: its outputs finish with
`finish_reason="error"` and `RequestOutput.error` says why; the rest of the batch goes on. A
failure of the forward pass itself cannot be pinned on a request and is raised.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections import deque
from typing import Any

import torch

from turbollm.core.kv_cache_manager import KVCacheManager
from turbollm.core.kv_connector import make_scheduler_connector
from turbollm.core.kv_policy import get_kv_policy
from turbollm.core.kv_sizing import batched_tokens, kv_config_for_model, size_kv_cache
from turbollm.core.scheduler import Scheduler
from turbollm.core.sequence import Sequence
from turbollm.distributed.launch import torchrun_rank
from turbollm.distributed.pipeline_parallel import partition_layers
from turbollm.distributed.tensor_parallel import check_tensor_parallel
from turbollm.engine.output_processor import OutputProcessor, RequestState
from turbollm.engine.step_profile import profile_step_costs
from turbollm.engine_args import EngineArgs
from turbollm.errors import InvalidRequestError
from turbollm.executor import get_executor_class
from turbollm.executor.torchrun import run_worker
from turbollm.handoff.kv_cache_spec import KVCacheConfig
from turbollm.handoff.runner_output import SampledToken
from turbollm.handoff.scheduler_output import SchedulerOutput
from turbollm.kernels.dtypes import dense_dtype_name
from turbollm.kernels.forms import resolve_form
from turbollm.loader import LoadedModel, describe_model, load_model
from turbollm.log import init_logger
from turbollm.outputs import RequestOutput
from turbollm.sampling_params import SamplingParams
from turbollm.spec_decode.adaptive import AdaptivePlanner
from turbollm.kernels.limits import ROW_INVARIANT_ROWS
from turbollm.spec_decode.draft_model import check_draft_model
from turbollm.spec_decode.proposers import drafts_write_kv
from turbollm.worker.malloc_tuning import tune_malloc

logger = init_logger()


class LLMEngine:
    @classmethod
    def from_engine_args(cls, args: EngineArgs, loaded: LoadedModel | None = None) -> "LLMEngine":
        """The entry points' way in: the engine, or on a rank above 0 that torchrun started, that rank's worker
        loop (a worker of rank 0's engine) until rank 0 stops it; the process then exits."""
        if args.distributed_executor_backend == "torchrun" and torchrun_rank():
            raise SystemExit(0 if run_worker() else 1)
        return cls(args, loaded)

    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None):
        if args.distributed_executor_backend == "torchrun" and torchrun_rank():
            raise RuntimeError(f"torchrun rank {torchrun_rank()} runs a worker of rank 0's engine, not an engine: "
                               "build it with LLMEngine.from_engine_args (as LLM and the CLI do)")
        if args.world_size == 1 and torchrun_rank() is not None:
            logger.warning("torchrun started %s processes, but tensor_parallel_size x pipeline_parallel_size is 1: "
                           "each process runs an engine of its own", os.environ.get("WORLD_SIZE"))
        tune_malloc()
        executor_cls = get_executor_class(args.distributed_executor_backend)
        # a KV connector's scheduler half (core/kv_connector.py): a store folder that cannot be written fails here
        connector = make_scheduler_connector(args.kv_transfer_config)
        desc, loaded, draft_desc = self._read_model(args, loaded)
        self.config, self.tokenizer, self.quantization = desc.config, desc.tokenizer, desc.quantization
        self.resolved = desc.resolved
        check_tensor_parallel(self.config, args.tensor_parallel_size)
        if args.pipeline_parallel_size > 1:  # the stages' layers, resolved once: every rank reads the same
            stages = partition_layers(self.config, args.pipeline_parallel_size, args.pp_layer_partition)
            args = dataclasses.replace(args, pp_layer_partition=[len(r) for r in stages])
            logger.info("pipeline parallelism: %d stages of %s layers", len(stages), "+".join(str(len(r)) for r in stages))
        self.args = args
        # what a block's K/V depend on besides its tokens (the group's spec adds its own): in every prefix key, and
        # so in the name of every block a KV connector moves (a block store outlives the process)
        salt = repr((str(self.resolved.path) if self.resolved is not None else args.model, self.quantization,
                     args.qmatmul, resolve_form(args.kernel_form), dense_dtype_name(args.dtype))).encode()
        self.kv_config, self.max_model_len = size_kv_cache(args, self.config, args.kv_torch_dtype(self.quantization),
                                                           salt)
        # an evicted table no longer matches its prompt's block keys: no prefix caching under eviction
        self.kv_manager = KVCacheManager.from_config(
            self.kv_config, enable_caching=args.enable_prefix_caching and not get_kv_policy(args.kv_policy).evicts)
        self.kv_manager.connector = connector
        if connector is not None:
            connector.attach(self.kv_manager.pools, self.kv_manager.block_size)
        spec = args.speculative_config
        self.scheduler = Scheduler(self.kv_manager, args.max_num_seqs, batched_tokens(args), self.max_model_len,
                                   spec.num_speculative_tokens if spec is not None else 0,
                                   spec is not None and drafts_write_kv(spec))
        self.executor = executor_cls(args.engine_config(), self.kv_config, loaded, self._draft_kv_config(draft_desc))
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self._req_ids = itertools.count()
        # steps handed to the executor and not yet collected, with when each went (pipeline stages: several)
        self.scheduler.max_steps_in_flight = self.executor.max_steps_in_flight
        self._in_flight: deque[tuple[SchedulerOutput, float]] = deque()
        self._given: dict[str, None] = {}  # requests that finished at a token given with them: output at the next step
        self.step_counts = [0, 0, 0]  # steps collected, sequences and tokens they computed (stats())
        if spec is not None and spec.adaptive:  # the target's step cost by rows, measured now; every step refines it
            self.scheduler.planner = AdaptivePlanner(spec.num_speculative_tokens, ROW_INVARIANT_ROWS)
            profile_step_costs(self)
            self.step_counts = [0, 0, 0]

    @staticmethod
    def _read_model(args: EngineArgs, loaded: LoadedModel | None):
        """(the model's description, the model loaded in this process or None, the draft model's description or
        None). The config and tokenizer are read without the weights where something needs them before (or
        instead of) loading: the checks of a draft model and of an evicting KV policy, which fail before any
        load, or worker processes that load the weights themselves."""
        spec = args.speculative_config
        draft = spec is not None and spec.method == "draft_model"
        evicts = get_kv_policy(args.kv_policy).evicts
        uni = args.distributed_executor_backend == "uni"
        desc = loaded
        if desc is None and (draft or evicts or not uni):
            desc = describe_model(args.model, quantization=args.quantization)
        draft_desc = check_draft_model(spec.model, desc, spec.quantization) if draft else None
        if evicts:  # a model the policy cannot take
            kv_config_for_model(desc.config, 1, args.block_size, policy=args.kv_policy_config())
        if uni:
            if args.threads:  # before loading: load-time work (dequantizing, quantizing) uses them too
                torch.set_num_threads(args.threads)
            loaded = loaded or load_model(args.model, quantization=args.quantization)
            return loaded, loaded, draft_desc
        if loaded is not None:  # the workers load the weights; this process needs the config and the tokenizer
            raise InvalidRequestError("a model loaded in this process cannot be handed to a worker process; "
                                      "pass the model's name (the worker loads it)")
        return desc, None, draft_desc

    def _draft_kv_config(self, draft_desc) -> KVCacheConfig | None:
        """A draft model's K/V: the target pool's number of blocks (it is addressed through the target's tables),
        in the target's float dtype (float16 beside a quantized target format)."""
        if draft_desc is None:
            return None
        kv = self.kv_config
        dtype = kv.dtype if kv.dtype.is_floating_point else torch.float16
        return kv_config_for_model(draft_desc.config, kv.num_blocks, kv.block_size, dtype)

    @property
    def loaded(self) -> LoadedModel | None:
        """The model, when its worker runs in this process (None with a worker process)."""
        return getattr(self.executor, "loaded", None)

    @property
    def footprint(self):
        """The model's `ModelFootprint` (plain data), as its worker reports it."""
        return self.executor.footprint

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.output_processor.requests

    def shutdown(self) -> None:
        """Stop the executor's workers (a worker process exits)."""
        self.executor.shutdown()

    # ----------------------------------------------------------------- requests
    def add_request(self, prompt: str | dict[str, Any] | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; return its id. Raises InvalidRequestError for bad prompts."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._req_ids))
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        params.check_token_ids(self.config.vocab_size)
        if params.n > self.args.max_num_seqs:
            raise InvalidRequestError(f"SamplingParams.n: {params.n} samples cannot run together with "
                                      f"max_num_seqs={self.args.max_num_seqs}")
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty (0 tokens)")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but the maximum context length is {self.max_model_len} "
                f"(room is needed for at least one generated token)")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        # With n > 1 one sequence computes the prompt; its siblings fork off it (sharing its
        # blocks, copy-on-write) when the first token is sampled.
        ends = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            ends |= set(self.tokenizer.eos_token_ids)
        seq = Sequence(self.scheduler.next_seq_id(), request_id, 0, list(ids), params, end_token_ids=frozenset(ends))
        seq.pending_forks = params.n - 1
        first = self._given_first_token(params)
        self.output_processor.add(RequestState(request_id, text, list(ids), params, [seq], time.monotonic()))
        self.scheduler.add(seq)
        if first is not None:  # a decode instance's request: the prefill instance's token is its first
            seq.output_token_ids.append(first.token_id)
            self.scheduler._check_stop(seq, first.token_id)  # (end tokens, max_tokens: sets the finish reason)
            self.output_processor.apply_given(seq, first)  # (text, logprobs, stop strings)
            if seq.finish_reason is not None and not seq.is_finished:
                self.scheduler.finish(seq)
            if seq.is_finished:
                self._given[request_id] = None  # its output comes with the next step
        return request_id

    def _given_first_token(self, params: SamplingParams) -> SampledToken | None:
        """`kv_transfer_params.first_token` of a decode instance's request (the prefill instance's sample), checked."""
        first = (params.kv_transfer_params or {}).get("first_token")
        if first is None:
            return None
        try:
            token = SampledToken(int(first["id"]), float(first.get("logprob", 0.0)), int(first.get("rank", 0)),
                                 [(int(t), float(lp)) for t, lp in first.get("top", [])])
        except (KeyError, TypeError, ValueError):
            raise InvalidRequestError("kv_transfer_params.first_token: expected {\"id\": token id, \"logprob\", "
                                      "\"rank\", \"top\": [[id, logprob], ...]}") from None
        if not 0 <= token.token_id < self.config.vocab_size:
            raise InvalidRequestError(f"kv_transfer_params.first_token: token id {token.token_id} is outside the "
                                      f"vocabulary [0, {self.config.vocab_size})")
        if params.n != 1:
            raise InvalidRequestError("kv_transfer_params.first_token takes n = 1 (each sample draws its own first "
                                      "token)")
        return token

    def _prompt_ids(self, prompt: str | dict[str, Any] | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}")

    def abort(self, request_id: str) -> None:
        self.output_processor.abort(request_id)

    def stats(self) -> dict[str, float | int | list[int]]:
        """Engine counters: requests, KV blocks and bytes (in use, peak, allocated), prefix cache (tokens),
        preemptions, blocks evicted by an attention-score policy; with a KV connector its counters
        (core/kv_connector.py: blocks and bytes loaded and saved, load failures); with speculation,
        its counters (`spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens`, and
        `spec_decode_accepted_per_pos`: drafts accepted at each position)."""
        pool, sched = self.kv_manager, self.scheduler
        return {
            "num_requests_running": len(sched.running), "num_requests_waiting": len(sched.waiting),
            "kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used, "kv_blocks_free": pool.num_free,
            "kv_cache_usage": pool.usage, "kv_cache_bytes_used": pool.bytes_used,
            "kv_cache_bytes_peak": pool.peak_bytes, "kv_cache_bytes_total": self.kv_config.total_bytes,
            "prefix_cache_queries": pool.stats.queries,
            "prefix_cache_hits": pool.stats.hits, "prefix_cache_evictions": pool.stats.evictions,
            "num_preemptions": sched.num_preemptions, "kv_evicted_blocks": pool.num_evicted_blocks,
            "num_steps": self.step_counts[0], "num_step_seqs": self.step_counts[1],
            "num_step_tokens": self.step_counts[2], "kv_groups": self._kv_group_stats(),
            **(self._spec_stats() if sched.speculates else {}),
            **(pool.connector.snapshot() if pool.connector is not None else {}),
        }

    def _kv_group_stats(self) -> list[dict[str, int | str]]:
        """Per KV group: its kind (full, sliding, ...), layers, blocks used / total, K/V bytes in use, dtype;
        a quantized format's float16 rings of recent tokens are one more entry (kind "recent": the pool blocks
        the running sequences' rings take, in every group; the groups' entries count the other blocks)."""
        pool, cfg = self.kv_manager, self.kv_config
        ring = pool.num_rings * pool.ring_blocks  # blocks of each group
        out: list[dict[str, int | str]] = [
            {"group": g, "kind": grp.spec.kind, "layers": len(grp.layer_ids), "blocks_used": p.num_used - ring,
             "blocks_total": cfg.blocks_of(g), "bytes_used": (p.num_used - ring) * pool.block_bytes[g],
             "dtype": cfg.format_name}
            for g, (grp, p) in enumerate(zip(cfg.groups, pool.pools))]
        if pool.ring_blocks:
            out.append({"group": len(out), "kind": "recent", "layers": cfg.num_layers, "blocks_used": ring,
                        "blocks_total": 0, "bytes_used": ring * sum(pool.block_bytes), "dtype": "float16"})
        return out

    def _spec_stats(self) -> dict[str, int | list[int]]:
        sched = self.scheduler
        return {**{"spec_decode_" + k: v for k, v in sched.spec_counts.items()},
                "spec_decode_accepted_per_pos": list(sched.spec_accepted_per_pos)}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._given)

    def poll_kv_connector(self) -> bool:
        """Between requests: finish what the outside finished (a p2p producer frees the blocks consumers took, or
        that expired), as each schedule does; whether blocks are still held, so that an idle server polls again."""
        c = self.kv_manager.connector
        if c is None:
            return False
        c.poll()
        return c.holding

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Hand out steps until the executor has `max_steps_in_flight` (1, or a pipeline's stages) or nothing
        more can be scheduled, then take the oldest one's output and return what it finished or advanced."""
        touched, self._given = self._given, {}
        while len(self._in_flight) < self.executor.max_steps_in_flight:
            sched = self.scheduler.schedule()
            try:
                for sid in sched.unschedulable_seq_ids:
                    seq = self.scheduler.seqs[sid]
                    self.output_processor.fail(seq.request_id, f"the sequence needs {seq.num_tokens} tokens of KV "
                                                               f"cache but the cache holds "
                                                               f"{self.kv_config.num_tokens or 'less'}; raise "
                                                               f"kv_cache_memory or lower max_model_len")
                    touched[seq.request_id] = None
                if sched.is_empty:
                    break
                self._note_first_scheduled(sched)
                self.executor.submit(sched)
            except BaseException:  # not handed out: its sequences may be scheduled again
                self.scheduler.returned(sched)
                raise
            self._in_flight.append((sched, time.perf_counter()))
        if not self._in_flight:
            if not touched and self.scheduler.has_unfinished():
                raise RuntimeError("internal error: the scheduler made no progress with requests waiting")
            return self.output_processor.outputs(touched)
        sched, t0 = self._in_flight.popleft()
        try:
            out = self.executor.collect()
        finally:
            self.scheduler.returned(sched)
        self.scheduler.observe_step(sched, out, time.perf_counter() - t0)
        self.step_counts[0] += 1
        self.step_counts[1] += len(sched.scheduled_token_ids)
        self.step_counts[2] += sum(map(len, sched.scheduled_token_ids.values()))
        update = self.scheduler.update_from_output(sched, out)
        return self.output_processor.process(update, touched)

    def _note_first_scheduled(self, sched) -> None:
        now = time.monotonic()
        for new in sched.new_reqs:
            seq = self.scheduler.seqs.get(new.seq_id)
            req = self.requests.get(seq.request_id) if seq is not None else None
            if req is not None and req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.num_cached_tokens = new.num_computed_tokens  # prompt tokens the prefix cache served
