"""Streaming deltas: what changed between successive RequestOutputs of one request.

`RequestOutput`s are cumulative (the whole text and every token id so far). A streaming
front end (the server's SSE, `turbollm chat`) sends only what is new; `DeltaTracker` keeps,
per completion index, what has been handed out and returns the rest.

Stop strings: the engine truncates the final text where a stop string begins, but while a
stop string is still being written its first characters are already in the cumulative text.
Given the request's stop strings, the tracker holds back any tail of the text that could be
the start of one, so the deltas never have to be taken back; the concatenated deltas equal
the final text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from turbollm.outputs import CompletionOutput, PositionLogprobs, RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class Delta:
    """What is new in one completion since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _State:
    text_sent: str = ""
    tokens_sent: int = 0
    logprobs_sent: int = 0
    finished: bool = False


@dataclass
class DeltaTracker:
    """Turns the cumulative outputs of one request into deltas.

    >>> tracker = DeltaTracker(stop=params.stop_strings)
    >>> async for out in engine.generate(prompt, params):
    ...     for d in tracker.update(out):
    ...         send(d.index, d.text, d.token_ids, d.finish_reason)
    """

    stop: Sequence[str] | str | None = None
    _states: dict[int, _State] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self._stops = [s for s in stops if s]

    def update(self, output: RequestOutput) -> list[Delta]:
        """Deltas of the completions that changed (new text or tokens, or newly finished)."""
        deltas = []
        for c in output.outputs:
            d = self.update_completion(c)
            if d is not None:
                deltas.append(d)
        return deltas

    def update_completion(self, c: CompletionOutput) -> Delta | None:
        st = self._states.setdefault(c.index, _State())
        if st.finished:
            return None
        finished = c.finish_reason is not None
        text = c.text if finished else c.text[:len(c.text) - self._holdback(c.text)]
        if text.startswith(st.text_sent):
            new_text = text[len(st.text_sent):]
        else:
            # Only the held-back tail may move; text that was sent cannot be taken back. A final
            # text that disagrees with what was streamed would be an engine bug: say so, send the rest.
            common = _common_prefix_len(text, st.text_sent)
            logger.warning("completion %d: the text changed under the stream: sent %r, now %r",
                           c.index, st.text_sent[common:], text[common:])
            new_text = text[len(st.text_sent):] if len(text) > len(st.text_sent) else ""
        new_ids = list(c.token_ids[st.tokens_sent:])
        new_lps = None
        if c.logprobs is not None:
            new_lps = list(c.logprobs[st.logprobs_sent:])
            st.logprobs_sent = len(c.logprobs)
        st.text_sent += new_text
        st.tokens_sent = len(c.token_ids)
        st.finished = finished
        if not new_text and not new_ids and not finished:
            return None
        return Delta(c.index, new_text, new_ids, new_lps, c.finish_reason, c.stop_reason)

    def text(self, index: int = 0) -> str:
        """All the text handed out so far for completion `index`."""
        st = self._states.get(index)
        return st.text_sent if st else ""

    def _holdback(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def iter_deltas(outputs: Iterable[RequestOutput], stop: Sequence[str] | str | None = None) -> Iterable[Delta]:
    """Deltas of a stream of cumulative outputs of one request (synchronous convenience)."""
    tracker = DeltaTracker(stop)
    for out in outputs:
        yield from tracker.update(out)
