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
from turbollm.core.kv_policy import get_kv_policy
from turbollm.core.kv_sizing import default_kv_budget, kv_config_for_model, kv_config_from_budget
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
from turbollm.handoff.scheduler_output import SchedulerOutput
from turbollm.kernels.forms import resolve_form
from turbollm.loader import LoadedModel, describe_model, load_model
from turbollm.log import init_logger
from turbollm.outputs import RequestOutput
from turbollm.sampling_params import SamplingParams
from turbollm.spec_decode.adaptive import AdaptivePlanner
from turbollm.spec_decode.config import ROW_INVARIANT_ROWS
from turbollm.spec_decode.draft_model import check_draft_model
from turbollm.spec_decode.proposers import ProposerContext, make_proposer
from turbollm.worker.draft_runner import DraftRunner
from turbollm.worker.malloc_tuning import tune_malloc

logger = init_logger()


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None):
        if args.distributed_executor_backend == "torchrun" and torchrun_rank():
            ok = run_worker()  # a rank > 0 that torchrun started: a worker of rank 0's engine, until it stops
            raise SystemExit(0 if ok else 1)
        if args.world_size == 1 and torchrun_rank() is not None:
            logger.warning("torchrun started %s processes, but tensor_parallel_size x pipeline_parallel_size is 1: "
                           "each process runs an engine of its own", os.environ.get("WORLD_SIZE"))
        self.args = args
        tune_malloc()
        executor_cls = get_executor_class(args.distributed_executor_backend)
        spec = args.speculative_config
        draft = spec is not None and spec.method == "draft_model"
        kv_policy = get_kv_policy(args.kv_policy)
        uni = args.distributed_executor_backend == "uni"
        # the model's config and tokenizer without its weights, read once, where something needs them
        # before (or instead of) loading: the checks below, or worker processes that load it themselves
        desc = loaded
        if desc is None and (draft or kv_policy.evicts or not uni):
            desc = describe_model(args.model, quantization=args.quantization)
        if draft:  # a draft that cannot serve fails before any load
            check_draft_model(spec.model, desc, spec.quantization)
        if kv_policy.evicts:  # a model the policy cannot take fails before loading
            kv_config_for_model(desc.config, 1, args.block_size, policy=args.kv_policy_config())
        if uni:
            if args.threads:  # before loading: load-time work (dequantizing, quantizing) uses them too
                torch.set_num_threads(args.threads)
            loaded = loaded or load_model(args.model, quantization=args.quantization)
            desc = loaded
        elif loaded is not None:  # the workers load the weights; this process needs the config and the tokenizer
            raise InvalidRequestError("a model loaded in this process cannot be handed to a worker process; "
                                      "pass the model's name (the worker loads it)")
        self.config, self.tokenizer, self.quantization = desc.config, desc.tokenizer, desc.quantization
        self.resolved = desc.resolved
        tp = args.tensor_parallel_size
        check_tensor_parallel(self.config, tp)
        if args.pipeline_parallel_size > 1:  # the stages' layers, resolved once: every rank reads the same
            stages = partition_layers(self.config, args.pipeline_parallel_size, args.pp_layer_partition)
            self.args = args = dataclasses.replace(args, pp_layer_partition=[len(r) for r in stages])
            logger.info("pipeline parallelism: %d stages of %s layers", len(stages), "+".join(str(len(r)) for r in stages))
        # the KV cache is described per rank: each rank keeps its share of the KV heads (all of them when
        # there are fewer heads than ranks: each is then kept by several ranks)
        kv_model = self.config if tp == 1 else dataclasses.replace(
            self.config, num_kv_heads=max(1, self.config.num_kv_heads // tp))
        policy = args.kv_policy_config()
        trained = self.config.max_position_embeddings
        if kv_policy.releases_all:  # every position meets keys at most a window away
            model_len = args.max_model_len or trained
        else:
            model_len = min(args.max_model_len or trained, trained)
        kv_dtype = args.kv_torch_dtype(self.quantization)
        budget = args.kv_cache_bytes() // tp  # the budget is the whole engine's: each rank holds its share
        spec_tokens = spec.num_speculative_tokens if spec is not None else 0  # drafts' blocks (window caps)
        if args.kv_cache_memory is None:  # never more than max_num_seqs sequences of the full context
            budget = min(budget, default_kv_budget(kv_model, kv_dtype, args.block_size, model_len,
                                                   args.max_num_seqs, policy, self._batched_tokens(args),
                                                   spec_tokens, args.kv_recent_window or 0))
        # what a block's K/V depend on besides its tokens (the group's spec adds its own): in every prefix key
        salt = repr((str(self.resolved.path) if self.resolved is not None else args.model, self.quantization,
                     args.qmatmul, resolve_form(args.kernel_form))).encode()
        self.kv_config = kv_config_from_budget(kv_model, budget, args.block_size, kv_dtype, salt,
                                               policy, args.max_num_seqs, self._batched_tokens(args),
                                               spec_tokens, args.kv_recent_window or 0)
        # an evicted table no longer matches its prompt's block keys: no prefix caching under eviction
        caching = args.enable_prefix_caching and not kv_policy.evicts
        self.kv_manager = KVCacheManager.from_config(self.kv_config, enable_caching=caching)
        held = self.kv_config.num_tokens
        logger.info("KV cache: %s, %.0f MiB (%s; %s; prefix caching %s)",
                    f"{self.kv_config.num_blocks} blocks of {args.block_size} tokens = {held} tokens" if held
                    else "sequences of any length at flat memory" if kv_policy.releases_all
                    else "each sequence within its budget", self.kv_config.total_bytes / (1 << 20),
                    self.kv_config.format_name, self.kv_config.describe(),
                    "on" if caching else f"off: kv_policy {policy.name!r} evicts" if kv_policy.evicts else "off")
        if self.kv_config.recent_slots and held is not None:
            float16 = kv_config_for_model(kv_model, 1, args.block_size, torch.float16).bytes_per_token
            logger.info("KV cache: %s blocks of %.0f bytes a token with %d-token float16 rings for %d sequences: %.2fx "
                        "the tokens float16 K/V would hold in the same budget", args.kv_cache_dtype,
                        self.kv_config.bytes_per_token, args.kv_recent_window, self.kv_config.recent_slots,
                        float16 * self.kv_config.num_tokens / max(1, self.kv_config.total_bytes))
        self._check_one_sequence_fits(args, spec_tokens, model_len)
        if held is not None and model_len > held:
            # One sequence must always fit the pool alone, or it would preempt itself forever.
            logger.warning("max_model_len %d is more than the KV cache holds: capped to %d tokens (raise "
                           "kv_cache_memory for the full context)", model_len, self.kv_config.num_tokens)
            model_len = self.kv_config.num_tokens
        self.max_model_len = model_len
        self.scheduler = Scheduler(self.kv_manager, args.max_num_seqs, self._batched_tokens(args), model_len,
                                   None, spec.num_speculative_tokens if spec is not None else 0)
        self.executor = executor_cls(args, self.kv_config, loaded)
        if spec is not None:
            self.scheduler.proposer = make_proposer(spec, ProposerContext(
                args, self.kv_config, block_table=lambda seq_id: self.scheduler.seqs[seq_id].block_tables[0],
                make_draft_runner=lambda config: self._load_draft(config, args)))
            if spec.adaptive:  # the target's step cost by rows, measured now; then every step refines it
                self.scheduler.planner = AdaptivePlanner(spec.num_speculative_tokens, ROW_INVARIANT_ROWS)
                scratch = profile_step_costs(self.executor, self.kv_manager, self.scheduler.planner.costs,
                                             self.scheduler.next_seq_id())
                self.scheduler.finish_scratch(scratch)
                self.scheduler.planner.profile_seq_id = scratch
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self._req_ids = itertools.count()
        # steps handed to the executor and not yet collected, with when each went (pipeline stages: several)
        self.scheduler.max_steps_in_flight = self.executor.max_steps_in_flight
        self._in_flight: deque[tuple[SchedulerOutput, float]] = deque()
        self.step_counts = [0, 0, 0]  # steps collected, sequences and tokens they computed (stats())

    def _load_draft(self, config, args: EngineArgs) -> DraftRunner:
        """The draft model's runner, its K/V sized here with the target pool's number of blocks."""
        kv = self.kv_config
        return DraftRunner.load(config, args, kv,
                                lambda cfg, dtype: kv_config_for_model(cfg, kv.num_blocks, kv.block_size, dtype))

    def _check_one_sequence_fits(self, args: EngineArgs, spec_tokens: int, model_len: int) -> None:
        """A group that releases blocks must hold one sequence's window alone (else a long sequence would
        preempt itself forever), or its whole context when that is shorter; a group that keeps every block
        bounds max_model_len instead."""
        for g, group in enumerate(self.kv_config.groups):
            need = group.spec.max_blocks(1, self._batched_tokens(args), spec_tokens)
            if need is not None:  # a sequence alone never copies on write: its whole context at most
                need = min(need, -(-model_len // args.block_size))
            if need is not None and self.kv_config.blocks_of(g) < need and self.kv_config.num_tokens is None:
                raise InvalidRequestError(
                    f"kv_cache_memory holds {self.kv_config.blocks_of(g)} blocks for the {group.spec.kind} layers but "
                    f"one sequence needs {need}: raise kv_cache_memory or lower kv_window / kv_budget / "
                    "max_num_batched_tokens")

    @staticmethod
    def _batched_tokens(args: EngineArgs) -> int:
        """The scheduler's token budget per step (at least a block)."""
        return max(args.max_num_batched_tokens, args.block_size)

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
        self.output_processor.add(RequestState(request_id, text, list(ids), params, [seq], time.monotonic()))
        self.scheduler.add(seq)
        return request_id

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
        preemptions, blocks evicted by an attention-score policy; with speculation,
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
            **(self._spec_stats() if sched.proposer is not None else {}),
        }

    def _kv_group_stats(self) -> list[dict[str, int | str]]:
        """Per KV group: its kind (full, sliding, ...), layers, blocks used / total, K/V bytes in use, dtype;
        a quantized format's float16 rings of recent tokens are one more entry (kind "recent")."""
        pool, cfg = self.kv_manager, self.kv_config
        out: list[dict[str, int | str]] = [
            {"group": g, "kind": grp.spec.kind, "layers": len(grp.layer_ids), "blocks_used": p.num_used,
             "blocks_total": cfg.blocks_of(g), "bytes_used": p.num_used * pool.block_bytes[g],
             "dtype": cfg.format_name}
            for g, (grp, p) in enumerate(zip(cfg.groups, pool.pools))]
        if pool.ring_bytes:
            out.append({"group": len(out), "kind": "recent", "layers": cfg.num_layers, "blocks_used": 0,
                        "blocks_total": 0, "bytes_used": len(pool.holding) * pool.ring_bytes, "dtype": "float16"})
        return out

    def _spec_stats(self) -> dict[str, int | list[int]]:
        sched = self.scheduler
        return {**{"spec_decode_" + k: v for k, v in sched.spec_counts.items()},
                "spec_decode_accepted_per_pos": list(sched.spec_accepted_per_pos)}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Hand out steps until the executor has `max_steps_in_flight` (1, or a pipeline's stages) or nothing
        more can be scheduled, then take the oldest one's output and return what it finished or advanced."""
        touched: dict[str, None] = {}
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
        self.scheduler.observe_step(sched, time.perf_counter() - t0)
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
