"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

`add_request` validates a request and queues its sequences (n of them); `step` asks the
scheduler for a batch, runs it, samples, advances the counters, detokenizes, applies the
stop rules and returns the outputs of every request that changed. `abort` ends a
request at once and returns its KV blocks.

Limits: `max_model_len` is capped at start-up to the tokens the KV pool holds (with a log
line), so one sequence always fits the pool alone and the scheduler always makes progress.
A failure that belongs to one request (its sampling, its stop checks, its detokenization, a
sequence the pool cannot hold) ends that request only: its outputs finish with
`finish_reason="error"` and `RequestOutput.error` says why; the rest of the batch goes on. A
failure of the forward pass itself cannot be pinned on a request and is raised.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch

from turbollm.attention import get_attention_backend
from turbollm.engine.detokenizer import IncrementalDetokenizer
from turbollm.engine.engine_args import EngineArgs
from turbollm.engine.kv_cache import BlockPool, KVCacheSpec, allocate_kv_storage, default_kv_budget
from turbollm.engine.malloc_tuning import tune_malloc
from turbollm.engine.model_runner import ModelRunner
from turbollm.engine.sampler import Sampler, SampleResult, token_rank
from turbollm.engine.scheduler import Scheduler
from turbollm.engine.sequence import Sequence
from turbollm.errors import InvalidRequestError
from turbollm.loader import LoadedModel, load_model
from turbollm.log import init_logger
from turbollm.outputs import CompletionOutput, Logprob, RequestOutput
from turbollm.sampling_params import SamplingParams

logger = init_logger()


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float  # time.monotonic()
    first_scheduled_time: float | None = None  # time.monotonic() of the first step that ran it
    error: str | None = None  # why the request failed (its outputs finish with "error")


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None):
        self.args = args
        if args.threads:
            torch.set_num_threads(args.threads)
        tune_malloc()
        self.loaded = loaded or load_model(args.model, quantization=args.quantization)
        self.config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        model_len = min(args.max_model_len or self.config.max_position_embeddings,
                        self.config.max_position_embeddings)
        kv_dtype = args.kv_torch_dtype(self.loaded.quantization)
        budget = args.kv_cache_bytes()
        if args.kv_cache_memory is None:  # never more than max_num_seqs sequences of the full context
            budget = min(budget, default_kv_budget(self.config, kv_dtype, args.block_size, model_len,
                                                   args.max_num_seqs))
        self.kv_spec = KVCacheSpec.from_budget(self.config, budget, args.block_size, kv_dtype)
        self.pool = BlockPool(self.kv_spec.num_blocks, enable_caching=args.enable_prefix_caching)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens, %.0f MiB (%s, prefix caching %s)",
                    self.kv_spec.num_blocks, args.block_size, self.kv_spec.num_tokens,
                    self.kv_spec.total_bytes / (1 << 20), str(self.kv_spec.dtype).replace("torch.", ""),
                    "on" if args.enable_prefix_caching else "off")
        if model_len > self.kv_spec.num_tokens:
            # One sequence must always fit the pool alone, or it would preempt itself forever.
            logger.warning("max_model_len %d is more than the KV cache holds: capped to %d tokens (raise "
                           "kv_cache_memory for the full context)", model_len, self.kv_spec.num_tokens)
            model_len = self.kv_spec.num_tokens
        self.max_model_len = model_len
        self.scheduler = Scheduler(self.pool, args.block_size, args.max_num_seqs,
                                   max(args.max_num_batched_tokens, args.block_size))
        self.runner = ModelRunner(self.loaded.model, allocate_kv_storage(self.kv_spec), args.block_size,
                                  get_attention_backend(args.attention_backend), fused_decode=not args.enforce_eager)
        self.sampler = Sampler(args.seed)
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()

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
        seq = self._new_seq(request_id, 0, list(ids), params)
        seq.pending_forks = params.n - 1
        self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, text, list(ids), params, [seq], time.monotonic())
        return request_id

    def _new_seq(self, request_id: str, index: int, ids: list[int], params: SamplingParams) -> Sequence:
        seq = Sequence(next(self._seq_ids), request_id, index, ids, params)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed + index)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        return seq

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Create the parent's n-1 siblings, sharing its computed blocks."""
        req = self.requests[parent.request_id]
        children = []
        for i in range(1, parent.pending_forks + 1):
            child = self._new_seq(parent.request_id, i, list(parent.prompt_token_ids), parent.params)
            child.num_computed_tokens = parent.num_computed_tokens
            child.block_table = list(parent.block_table)
            child.block_hashes = list(parent.block_hashes)
            child.num_cached_blocks = parent.num_cached_blocks
            for b in child.block_table:
                self.pool.touch(b)
            self.scheduler.add_running(child)
            req.seqs.append(child)
            children.append(child)
        parent.pending_forks = 0
        return children

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
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def _fail(self, request_id: str, error: str) -> None:
        """End every sequence of one request with finish_reason "error"; its next output says why."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.error is None:
            logger.error("request %s failed: %s", request_id, error)
            req.error = error
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "error"
                self.scheduler.finish(seq)

    def stats(self) -> dict[str, float | int]:
        """Engine counters: requests, KV blocks, prefix cache (tokens), preemptions."""
        pool, sched = self.pool, self.scheduler
        return {
            "num_requests_running": len(sched.running), "num_requests_waiting": len(sched.waiting),
            "kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used, "kv_blocks_free": pool.num_free,
            "kv_cache_usage": pool.usage, "prefix_cache_queries": pool.stats.queries,
            "prefix_cache_hits": pool.stats.hits, "prefix_cache_evictions": pool.stats.evictions,
            "num_preemptions": sched.num_preemptions,
        }

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        touched: dict[str, None] = {}
        for seq in sched.unschedulable:
            self._fail(seq.request_id, f"the sequence needs {seq.num_tokens} tokens of KV cache but the cache holds "
                                       f"{self.kv_spec.num_tokens}; raise kv_cache_memory or lower max_model_len")
            touched[seq.request_id] = None
        if sched.is_empty:
            if not touched and self.scheduler.has_unfinished():
                raise RuntimeError("internal error: the scheduler made no progress with requests waiting")
            return self._outputs(touched)
        now = time.monotonic()
        for s in sched.scheduled:
            req = self.requests.get(s.seq.request_id)
            if req is not None and req.first_scheduled_time is None:
                req.first_scheduled_time = now
        out = self.runner.execute(sched)
        for i, (first_pos, logits) in out.prompt_logits.items():
            seq = sched.scheduled[i].seq
            self._guarded(seq, touched, self._record_prompt_logprobs, seq, first_pos, logits)
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.scheduler.cache_computed_blocks(s.seq)
        seqs, rows = [], []
        for row, i in enumerate(out.sample_index):
            seq = sched.scheduled[i].seq
            if seq.is_finished:  # failed above
                continue
            for sib in [seq] + (self._fork(seq) if seq.pending_forks else []):
                seqs.append(sib)
                rows.append(row)
        logits = out.sample_logits[rows] if rows != list(range(len(out.sample_index))) else out.sample_logits
        ends = [self._end_ids(seq) for seq in seqs]
        results = self.sampler.sample(logits, seqs, ends) if seqs else []
        for seq, res, end in zip(seqs, results, ends):
            touched[seq.request_id] = None
            if res.error is not None:
                self._fail(seq.request_id, f"sampling failed: {res.error}")
            elif not seq.is_finished:
                self._guarded(seq, touched, self._append_token, seq, res, end)
        return self._outputs(touched)

    def _guarded(self, seq: Sequence, touched: dict[str, None], fn, *args) -> None:
        """Run one request's share of the step's bookkeeping; an exception there fails that request only."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - isolate the request, keep the batch going
            logger.exception("processing request %s failed", seq.request_id)
            self._fail(seq.request_id, f"{type(e).__name__}: {e}")
            touched[seq.request_id] = None

    def _outputs(self, touched: dict[str, None]) -> list[RequestOutput]:
        return [self._request_output(self.requests[r]) for r in touched if r in self.requests]

    def _end_ids(self, seq: Sequence) -> set[int]:
        ends = set(seq.params.stop_token_ids or [])
        if not seq.params.ignore_eos:
            ends |= set(self.tokenizer.eos_token_ids)
        return ends

    def _append_token(self, seq: Sequence, res: SampleResult, end_ids: set[int]) -> None:
        p = seq.params
        seq.output_token_ids.append(res.token_id)
        seq.cumulative_logprob += res.logprob
        if p.logprobs is not None:
            entry = {res.token_id: Logprob(res.logprob, res.rank, self._piece(res.token_id))}
            for rank, (tid, lp) in enumerate(res.top, start=1):
                entry.setdefault(tid, Logprob(lp, rank, self._piece(tid)))
            seq.output_logprobs.append(entry)
        new_text = seq.detokenizer.add(res.token_id)
        seq.text += new_text
        n_out = len(seq.output_token_ids)
        if res.token_id in end_ids and n_out >= p.min_tokens:
            is_eos = res.token_id not in (p.stop_token_ids or [])
            self._finish(seq, "stop", None if is_eos else res.token_id)
            return
        if p.stop_strings and n_out >= p.min_tokens:
            window_start = max(0, len(seq.text) - len(new_text) - max(len(s) for s in p.stop_strings))
            for stop in p.stop_strings:
                idx = seq.text.find(stop, window_start)
                if idx >= 0:
                    seq.text = seq.text[:idx + (len(stop) if p.include_stop_str_in_output else 0)]
                    self._finish(seq, "stop", stop)
                    return
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len
        if n_out >= max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if not isinstance(stop_reason, str):
            # Release what the incremental detokenizer held back (a character cut by max_tokens). The
            # text stays the one streamed so far plus that tail: decoding the output alone would drop
            # a SentencePiece first token's leading space that the stream (decoded with the prompt
            # as context) has already sent.
            seq.text += seq.detokenizer.flush()
        self.scheduler.finish(seq)

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _record_prompt_logprobs(self, seq: Sequence, first_pos: int, logits: torch.Tensor) -> None:
        k = seq.params.prompt_logprobs
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if k:
            top_vals, top_idx = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        for row in range(logprobs.shape[0]):
            pos = first_pos + row
            if pos < len(seq.prompt_logprobs):  # recomputed after a preemption: already recorded
                continue
            token = seq.prompt_token_ids[pos]
            entry = {token: Logprob(float(logprobs[row, token]), token_rank(logprobs[row], token), self._piece(token))}
            if k:
                for rank, (tid, lp) in enumerate(zip(top_idx[row].tolist(), top_vals[row].tolist()), start=1):
                    entry.setdefault(tid, Logprob(lp, rank, self._piece(tid)))
            seq.prompt_logprobs.append(entry)

    def _request_output(self, req: _Request) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            outs.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if req.params.logprobs is not None else None,
                logprobs=seq.output_logprobs if req.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        finished = all(s.is_finished for s in req.seqs)
        prompt_lp = req.seqs[0].prompt_logprobs if req.params.prompt_logprobs is not None else None
        if finished:
            self.requests.pop(req.request_id, None)
        metrics = {"arrival_time": req.arrival_time, "first_scheduled_time": req.first_scheduled_time}
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, prompt_lp, metrics,
                             error=req.error)
