"""The caller's side of `AsyncLLMEngine`: the stream a coroutine iterates, its mailbox, and the
commands callers hand the worker thread.

`RequestStream` is what `AsyncLLMEngine.generate` returns; on its first iteration it submits an
`AddCommand` carrying a `Mailbox`, which the worker fills (through the caller's event loop) and the
stream reads. Leaving the stream early enqueues an `AbortCommand`. Threading and lifetimes:
`turbollm/entrypoints/async_engine.py`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from turbollm.outputs import RequestOutput
from turbollm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from turbollm.entrypoints.async_engine import AsyncLLMEngine

PromptType = str | dict[str, Any] | list[int]


# ------------------------------------------------------------------ worker commands
@dataclass
class AddCommand:
    request_id: str
    prompt: PromptType
    params: SamplingParams | None
    sink: "Mailbox"


@dataclass
class AbortCommand:
    request_id: str


@dataclass
class ShutdownCommand:
    drain: bool  # True: finish what is in flight; False: abort it


class Mailbox:
    """One request's mailbox: filled by the worker (through the caller's loop), read by its stream.

    Outputs are cumulative, so an output not yet read is replaced by a newer one: a slow
    reader gets fewer, fuller outputs and the mailbox never grows with the generation.
    """

    __slots__ = ("loop", "items", "ready", "last")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque[RequestOutput | BaseException] = deque()
        self.ready = asyncio.Event()
        self.last: RequestOutput | None = None  # worker side: the latest output posted

    def put(self, item: RequestOutput | BaseException) -> None:
        """From the worker thread."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        items = self.items
        if (items and isinstance(item, RequestOutput) and isinstance(items[-1], RequestOutput)
                and not items[-1].finished):
            items[-1] = item
        else:
            items.append(item)
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        return self.items.popleft()


# ------------------------------------------------------------------ the stream a caller iterates
class RequestStream:
    """Async iterator of one request's RequestOutputs (cumulative), ending after the finished one.

    Submitted on the first `__anext__`; leaving it early aborts the request.
    """

    def __init__(self, owner: "AsyncLLMEngine", request_id: str, prompt: PromptType,
                 params: SamplingParams | None):
        self._owner = owner
        self.request_id = request_id
        self._prompt = prompt
        self._params = params
        self._sink: Mailbox | None = None
        self._done = False
        self._registered = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if self._sink is None:
            self._sink = Mailbox(asyncio.get_running_loop())
            try:
                self._owner._submit(self)
            except BaseException:
                self._done = True
                raise
            self._registered = True
        try:
            item = await self._sink.get()
        except BaseException:  # cancelled (client gone, timeout): give the blocks back
            self._close(abort=True)
            raise
        if isinstance(item, BaseException):
            self._close(abort=False)
            raise item
        if item.finished:
            self._close(abort=False)
        return item

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it has not finished."""
        self._close(abort=True)

    def abort(self) -> None:
        self._close(abort=True)

    @property
    def finished(self) -> bool:
        return self._done

    def _close(self, abort: bool) -> None:
        if self._done:
            return
        self._done = True
        if self._registered:
            self._registered = False
            if abort:
                self._owner._enqueue(AbortCommand(self.request_id))
            self._owner._active.discard(self.request_id)

    def __del__(self) -> None:  # `break` out of `async for` drops the stream: abort at once
        try:
            self._close(abort=True)
        except Exception:
            pass
