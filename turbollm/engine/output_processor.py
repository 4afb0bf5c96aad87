"""The output processor: a step's sampled tokens → text, stop strings, logprobs with token text,
and a `RequestOutput` for every request that changed.

It owns the requests (`RequestState`: prompt, sequences, timing, error) and each sequence's
detokenizer. Stop strings are found here, since they need the text; a sequence that writes one
is finished through the scheduler (its text cut where the string begins). A failure in one
request's share of this work fails that request alone (`fail`), with `finish_reason="error"` and
`RequestOutput.error` saying why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from turbollm.core.scheduler import Scheduler, SchedulerUpdate, SeqUpdate
from turbollm.core.sequence import Sequence
from turbollm.engine.detokenizer import IncrementalDetokenizer
from turbollm.handoff.runner_output import PromptLogprobs, SampledToken
from turbollm.outputs import CompletionOutput, Logprob, RequestOutput
from turbollm.sampling_params import SamplingParams

logger = logging.getLogger("turbollm")


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float  # time.monotonic()
    first_scheduled_time: float | None = None  # time.monotonic() of the first step that ran it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache when it was first scheduled
    error: str | None = None  # why the request failed (its outputs finish with "error")


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler):
        self.tokenizer, self.scheduler = tokenizer, scheduler
        self.requests: dict[str, RequestState] = {}

    def add(self, req: RequestState) -> None:
        for seq in req.seqs:
            self._attach_detokenizer(seq)
        self.requests[req.request_id] = req

    def _attach_detokenizer(self, seq: Sequence) -> None:
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens)

    def fail(self, request_id: str, error: str) -> None:
        """End every sequence of one request with finish_reason "error"; its next output says why."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.error is None:
            logger.error("request %s failed: %s", request_id, error)
            req.error = error
        self._end(req, "error")

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self._end(req, "abort")

    def _end(self, req: RequestState, reason: str) -> None:
        """Finish every unfinished sequence of `req` with `reason`, returning its blocks."""
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = reason
                self.scheduler.finish(seq)

    # ------------------------------------------------------------------ a step's results
    def process(self, update: SchedulerUpdate, touched: dict[str, None]) -> list[RequestOutput]:
        for u in update.updates:  # siblings forked this step join their request first, so a failure ends them too
            req = self.requests.get(u.seq.request_id)
            if u.forked and req is not None:
                req.seqs.append(u.seq)
                self._attach_detokenizer(u.seq)
        for seq, error in update.failed:
            self.fail(seq.request_id, f"sampling failed: {error}")
            touched[seq.request_id] = None
        for u in update.updates:
            rid = u.seq.request_id
            touched[rid] = None
            req = self.requests.get(rid)
            if req is None or req.error is not None:
                continue
            try:
                self._apply(u)
            except Exception as e:  # noqa: BLE001 - isolate the request, keep the batch going
                logger.exception("processing request %s failed", rid)
                self.fail(rid, f"{type(e).__name__}: {e}")
        return self.outputs(touched)

    def _apply(self, u: SeqUpdate) -> None:
        seq = u.seq
        if u.prompt_logprobs is not None:
            self._record_prompt_logprobs(seq, u.prompt_logprobs)
        if not u.tokens:
            return
        p = seq.params
        for i, t in enumerate(u.tokens):  # several with speculation: a stop string ends the output at its token
            start = len(seq.text)
            self._record_logprobs(seq, t)
            seq.text += seq.detokenizer.add(t.token_id)
            later = len(u.tokens) - 1 - i  # this step's tokens after this one
            # (an end token that finished the sequence at its last token keeps its reason, as without speculation)
            if p.stop_strings and len(seq.output_token_ids) - later >= p.min_tokens \
                    and (later or seq.finish_reason != "stop") and self._find_stop(seq, start):
                del seq.output_token_ids[len(seq.output_token_ids) - later:]
                if not seq.is_finished:
                    self.scheduler.finish(seq)
                return
        if seq.is_finished:
            # Release what the incremental detokenizer held back (a character cut by max_tokens). The
            # text stays the one streamed so far plus that tail: decoding the output alone would drop
            # a SentencePiece first token's leading space that the stream (decoded with the prompt
            # as context) has already sent.
            seq.text += seq.detokenizer.flush()

    @staticmethod
    def _find_stop(seq: Sequence, start: int) -> bool:
        """Whether text added from `start` on completes a stop string: then cut the text there and set the reason."""
        p = seq.params
        window = max(0, start - max(len(s) for s in p.stop_strings))
        for stop in p.stop_strings:
            idx = seq.text.find(stop, window)
            if idx >= 0:
                seq.text = seq.text[:idx + (len(stop) if p.include_stop_str_in_output else 0)]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        return False

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _record_logprobs(self, seq: Sequence, t: SampledToken) -> None:
        seq.cumulative_logprob += t.logprob
        if seq.params.logprobs is None:
            return
        entry = {t.token_id: Logprob(t.logprob, t.rank, self._piece(t.token_id))}
        for rank, (tid, lp) in enumerate(t.top, start=1):
            entry.setdefault(tid, Logprob(lp, rank, self._piece(tid)))
        seq.output_logprobs.append(entry)

    def _record_prompt_logprobs(self, seq: Sequence, plp: PromptLogprobs) -> None:
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        for j, token in enumerate(plp.token_ids):
            if plp.first_pos + j < len(seq.prompt_logprobs):  # recomputed after a preemption: already recorded
                continue
            entry = {token: Logprob(plp.logprobs[j], plp.ranks[j], self._piece(token))}
            for rank, (tid, lp) in enumerate(plp.top[j], start=1):
                entry.setdefault(tid, Logprob(lp, rank, self._piece(tid)))
            seq.prompt_logprobs.append(entry)

    # ------------------------------------------------------------------ outputs
    def outputs(self, touched: dict[str, None]) -> list[RequestOutput]:
        return [self._request_output(self.requests[r]) for r in touched if r in self.requests]

    def _request_output(self, req: RequestState) -> RequestOutput:
        with_lp = req.params.logprobs is not None
        outs = [CompletionOutput(index=seq.index, text=seq.text, token_ids=list(seq.output_token_ids),
                                 cumulative_logprob=seq.cumulative_logprob if with_lp else None,
                                 logprobs=seq.output_logprobs if with_lp else None,
                                 finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
                for seq in req.seqs]
        finished = all(s.is_finished for s in req.seqs)
        prompt_lp = req.seqs[0].prompt_logprobs if req.params.prompt_logprobs is not None else None
        if finished:
            self.requests.pop(req.request_id, None)
        metrics = {"arrival_time": req.arrival_time, "first_scheduled_time": req.first_scheduled_time}
        first = req.seqs[0]
        handoff = {**first.kv_transfer_out, "first_token": self._first_token(first)} \
            if finished and first.kv_transfer_out and first.output_token_ids else None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, prompt_lp, metrics,
                             error=req.error, num_cached_tokens=req.num_cached_tokens, kv_transfer_params=handoff)

    @staticmethod
    def _first_token(seq: Sequence) -> dict:
        """A prefill instance's sampled token, as the decode instance takes it: id, logprob, rank, top k."""
        t, k = seq.output_token_ids[0], seq.params.logprobs or 0
        pos = seq.output_logprobs[0] if seq.output_logprobs else {}
        chosen = pos.get(t)
        top = sorted((lp.rank, tid, lp.logprob) for tid, lp in pos.items() if lp.rank is not None and lp.rank <= k)
        return {"id": t, "logprob": seq.cumulative_logprob, "rank": chosen.rank if chosen is not None else 0,
                "top": [[tid, lp] for _, tid, lp in top]}

    def apply_given(self, seq: Sequence, token: SampledToken) -> None:
        """A token sampled elsewhere (a decode instance's first token, sampled by the prefill instance) joins `seq`'s
        output as if this engine had sampled it: logprobs, text, stop strings (the caller applied the stop rules
        on token ids)."""
        self._apply(SeqUpdate(seq, tokens=[token]))
