"""AsyncLLMEngine: one LLMEngine stepped in a worker thread, many asyncio callers.

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model="smollm2-135m"))
    async with engine:
        async for out in engine.generate("The capital of France is", SamplingParams(max_tokens=16)):
            print(out.outputs[0].text)        # cumulative; see streaming.DeltaTracker for deltas

Threading: `LLMEngine` is synchronous and not thread-safe, so exactly one thread (the worker)
touches it once the wrapper runs. Callers hand it commands (add, abort, shutdown) through a
thread-safe queue; the worker drains the queue before every `step()` and posts each
request's outputs to that request's mailbox in the caller's event loop with
`loop.call_soon_threadsafe`. With no request in flight the worker blocks on the command
queue: no spinning. Outputs are cumulative (vLLM's default), so a reader that falls behind
gets the newest output in place of the ones it missed; `streaming.DeltaTracker` turns them
into deltas.

Lifetimes: a request is submitted on the first iteration of its stream and aborted (its KV
blocks returned) as soon as the stream is left early: `break` (the stream is dropped),
`aclose()`, the consuming task cancelled. `add_request` errors (InvalidRequestError, ...)
are raised to that caller only. An exception in `step()` fails the requests in flight with
`EngineStepError`, after aborting them; a failure the engine pins on one request (its
sampling or stop checks; `RequestOutput.error`) ends that stream alone with `RequestFailedError`.
The worker keeps serving unless the engine still
holds requests it could not abort, or the executor's worker process is gone (`WorkerDiedError`),
in which case it stops and every later call raises `EngineDeadError`. The caller's side (the stream, its mailbox, the commands) is in
`request_stream.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import uuid
from typing import Any

from turbollm.engine.llm_engine import LLMEngine
from turbollm.engine_args import EngineArgs
from turbollm.entrypoints.request_stream import (AbortCommand, AddCommand, Mailbox, PromptType, RequestStream,
                                                 ShutdownCommand)
from turbollm.errors import InvalidRequestError
from turbollm.executor.base import WorkerDiedError
from turbollm.outputs import CompletionOutput, RequestOutput
from turbollm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how often an idle worker frees a p2p producer's blocks that consumers took or let expire


class EngineDeadError(RuntimeError):
    """The async engine is shut down (or its worker stopped after an unrecoverable error)."""


class EngineStepError(RuntimeError):
    """`LLMEngine.step()` raised while this request was in flight; `__cause__` is the original error."""


class RequestFailedError(RuntimeError):
    """The engine ended this request alone on an error of its own (the others in the step went on)."""


# ------------------------------------------------------------------ the engine wrapper
class AsyncLLMEngine:
    """Serve one LLMEngine to many coroutines (see the module docstring).

    While the wrapper runs, only its worker thread may touch `engine`; after `shutdown()`
    the LLMEngine is whole again and can be used directly or wrapped anew.
    """

    def __init__(self, engine: LLMEngine, *, name: str = "turbollm-engine"):
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False  # no new requests (shutdown called or the worker died)
        self._dead_reason: str | None = None
        self._active: set[str] = set()  # request ids with a live stream (caller side)
        self._sinks: dict[str, Mailbox] = {}  # worker side
        self._draining = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_engine_args(args))

    @classmethod
    def from_model(cls, model: str = "smollm2-135m", **engine_args: Any) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_engine_args(EngineArgs.from_kwargs(model, **engine_args)))

    # ---------------------------------------------------------------- public API
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._closed

    @property
    def errored(self) -> bool:
        return self._dead_reason is not None

    @property
    def num_in_flight(self) -> int:
        """Requests whose streams are open (submitted, not finished, not left)."""
        return len(self._active)

    def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None) -> RequestStream:
        """`async for out in engine.generate(...)`: RequestOutputs as tokens arrive, the last one finished.

        Raises (on the first iteration) InvalidRequestError for a request the engine rejects or
        a request id already in flight, EngineDeadError after shutdown, EngineStepError when a
        step fails while the request runs.
        """
        return RequestStream(self, request_id if request_id is not None else uuid.uuid4().hex,
                             prompt, sampling_params)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a finished output whose finish_reason is "abort"."""
        self._enqueue(AbortCommand(request_id))

    async def shutdown(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the worker: abort what is in flight (or, with `drain`, let it finish) and wait for it."""
        self._request_shutdown(drain)
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            logger.warning("the engine worker did not stop within %s s", timeout)

    def shutdown_sync(self, drain: bool = False, timeout: float | None = None) -> None:
        """`shutdown` for code outside an event loop."""
        self._request_shutdown(drain)
        self._thread.join(timeout)

    async def __aenter__(self) -> "AsyncLLMEngine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    # ---------------------------------------------------------------- caller side
    def _enqueue(self, cmd: Any) -> None:
        # SimpleQueue.put is reentrant: safe from __del__.
        self._cmds.put(cmd)

    def _submit(self, stream: RequestStream) -> None:
        with self._lock:
            if self._closed:
                raise EngineDeadError(self._dead_reason or "the async engine is shut down")
            if stream.request_id in self._active:
                raise InvalidRequestError(f"request id {stream.request_id!r} is already in use")
            self._active.add(stream.request_id)
            self._cmds.put(AddCommand(stream.request_id, stream._prompt, stream._params, stream._sink))

    def _request_shutdown(self, drain: bool) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._cmds.put(ShutdownCommand(drain))

    # ---------------------------------------------------------------- worker side
    def _run(self) -> None:
        threads = getattr(self.engine.args, "threads", None)
        if threads:
            import torch

            torch.set_num_threads(threads)  # per-thread under OpenMP: set it where the steps run
        reason = "the async engine is shut down"
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the worker must not die silently
            logger.exception("the engine worker stopped on an error")
            reason = f"the engine worker stopped on an error: {type(e).__name__}: {e}"
            self._dead_reason = reason
        finally:
            with self._lock:
                self._closed = True
            # Nothing can be enqueued for us any more: answer what is left.
            for rid, sink in list(self._sinks.items()):
                self._abort_in_engine(rid)
                sink.put(EngineDeadError(reason) if self._dead_reason else _aborted(sink.last, rid, None))
            self._sinks.clear()
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, AddCommand):
                    cmd.sink.put(EngineDeadError(reason))

    def _serve(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            if not busy and self._draining:
                return
            try:
                # idle with blocks held for decode instances: wake now and then to free those taken or expired
                holding = not busy and engine.poll_kv_connector()
                cmd = self._cmds.get(block=not busy, timeout=IDLE_POLL_S if holding else None)
                while True:
                    if self._handle(cmd):
                        return
                    cmd = self._cmds.get_nowait()
            except queue.Empty:
                pass
            if engine.has_unfinished_requests():
                self._step()

    def _handle(self, cmd: Any) -> bool:
        """Apply one command; True to stop the worker now."""
        if isinstance(cmd, AddCommand):
            if self._draining:
                cmd.sink.put(EngineDeadError("the async engine is shutting down"))
                return False
            try:
                self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id)
            except Exception as e:  # invalid request: that caller's problem only
                cmd.sink.put(e)
                return False
            self._sinks[cmd.request_id] = cmd.sink
        elif isinstance(cmd, AbortCommand):
            sink = self._sinks.pop(cmd.request_id, None)
            if sink is not None:  # else finished already, or never ours
                info = self._request_info(cmd.request_id)
                self._abort_in_engine(cmd.request_id)
                sink.put(_aborted(sink.last, cmd.request_id, info))
        elif isinstance(cmd, ShutdownCommand):
            if not cmd.drain:
                for rid in list(self._sinks):
                    self._handle(AbortCommand(rid))
                return True
            self._draining = True
        return False

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing %d request(s) in flight", len(self._sinks))
            if isinstance(e, WorkerDiedError):  # closed before the callers hear: no request is taken after
                with self._lock:
                    self._closed = True
                    self._dead_reason = f"the engine worker stopped on an error: {type(e).__name__}: {e}"
            for rid, sink in list(self._sinks.items()):
                self._abort_in_engine(rid)
                err = EngineStepError(f"engine step failed: {type(e).__name__}: {e}")
                err.__cause__ = e
                sink.put(err)
            self._sinks.clear()
            if isinstance(e, WorkerDiedError):  # nothing can run any more: stop, so /health says so
                raise EngineDeadError(str(e)) from e
            if self.engine.has_unfinished_requests():
                raise EngineDeadError(f"the engine holds requests it cannot abort after a failed step: {e}") from e
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.error is not None:
                del self._sinks[out.request_id]
                sink.put(RequestFailedError(f"request {out.request_id} failed: {out.error}"))
                continue
            out = _snapshot(out)
            sink.last = out
            sink.put(out)
            if out.finished:
                del self._sinks[out.request_id]

    def _abort_in_engine(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("aborting request %r failed", request_id)

    def _request_info(self, request_id: str) -> tuple[str | None, list[int], int] | None:
        req = getattr(self.engine, "requests", {}).get(request_id)
        if req is None:
            return None
        try:
            return req.prompt, list(req.prompt_token_ids), req.params.n
        except AttributeError:
            return None


def _snapshot(out: RequestOutput) -> RequestOutput:
    """Copy the lists the engine keeps appending to, so the caller's view cannot move under it."""
    outs = [dataclasses.replace(c, token_ids=list(c.token_ids),
                                logprobs=list(c.logprobs) if c.logprobs is not None else None)
            for c in out.outputs]
    plp = list(out.prompt_logprobs) if out.prompt_logprobs is not None else None
    return dataclasses.replace(out, outputs=outs, prompt_logprobs=plp, metrics=dict(out.metrics))


def _aborted(last: RequestOutput | None, request_id: str,
             info: tuple[str | None, list[int], int] | None) -> RequestOutput:
    """The final output of an aborted request: what it had so far, finish_reason "abort"."""
    if last is not None:
        outs = [c if c.finish_reason is not None else dataclasses.replace(c, finish_reason="abort")
                for c in last.outputs]
        return dataclasses.replace(last, outputs=outs, finished=True)
    prompt, prompt_ids, n = info if info is not None else (None, [], 1)
    return RequestOutput(request_id, prompt, prompt_ids,
                         [CompletionOutput(i, "", [], finish_reason="abort") for i in range(n)], finished=True)
