"""`turbollm chat`: an interactive chat in the terminal, the reply streamed as it is generated.

Each turn renders the whole conversation with the model's chat template and streams the
reply to stdout (stdout carries the replies only; prompts, notices and the status line
`[42 tokens, 13.2 tok/s, TTFT 0.31 s]` go to stderr). Commands: `/exit`, `/quit` or EOF end
the chat, `/reset` clears the history, `/system TEXT` sets the system prompt (`/system`
alone clears it). Ctrl-C during a reply stops it (the partial reply is kept); Ctrl-C at the
prompt ends the chat. When the conversation no longer fits the context, the oldest turns
are dropped (the system prompt stays) and a notice says so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
import time
from typing import TextIO

from turbollm.cli.engine_flags import add_engine_flags, engine_args_from

HELP = ("commands: /exit or /quit (or Ctrl-D) to leave, /reset to clear the history, "
        "/system TEXT to set the system prompt")


def add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal")
    add_engine_flags(p)
    p.add_argument("--system", default=None, help="system prompt (default: the chat template's own, if any)")
    p.add_argument("--max-tokens", "-n", type=int, default=512, help="most tokens per reply (default: 512)")
    p.add_argument("--temperature", "-t", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.set_defaults(func=run_chat)


# ------------------------------------------------------------------ the conversation prompt
def render_conversation(tokenizer, system: str | None, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of system + messages in the model's chat template, ready for the assistant's reply."""
    convo = ([{"role": "system", "content": system}] if system else []) + list(messages)
    text = tokenizer.apply_chat_template(convo, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def build_prompt(tokenizer, system: str | None, messages: list[dict[str, str]],
                 max_prompt_tokens: int) -> tuple[list[int] | None, int]:
    """The prompt ids of the conversation, dropping the oldest turns until it fits.

    `messages` alternate user/assistant and end with the new user message. Returns (ids,
    number of leading messages dropped); ids is None when even the system prompt and the
    last user message alone do not fit.
    """
    start = 0
    while True:
        ids = render_conversation(tokenizer, system, messages[start:])
        if len(ids) <= max_prompt_tokens:
            return ids, start
        if len(messages) - start <= 1:
            return None, start
        start += 1  # drop one turn: a user message and the replies up to the next user message
        while start < len(messages) - 1 and messages[start]["role"] != "user":
            start += 1


# ------------------------------------------------------------------ one chat
class ChatSession:
    """A conversation over one LLMEngine; `send` streams one reply and records the turn."""

    def __init__(self, engine, params, system: str | None = None, out: TextIO | None = None,
                 err: TextIO | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.params = params
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.last_prompt_ids: list[int] | None = None
        self._turns = 0

    def reset(self) -> None:
        self.messages = []

    def notice(self, text: str) -> None:
        dim = self.err.isatty()
        self.err.write(f"\x1b[2m{text}\x1b[0m\n" if dim else f"{text}\n")
        self.err.flush()

    def send(self, user_text: str, stop_flag: "_Flag | None" = None) -> str | None:
        """Stream the reply to `user_text`; return it (None when the turn could not run)."""
        from turbollm.entrypoints.streaming import DeltaTracker
        from turbollm.errors import InvalidRequestError

        engine = self.engine
        max_len = engine.max_model_len
        reserve = max(1, min(self.params.max_tokens or max_len, max_len // 2))
        messages = self.messages + [{"role": "user", "content": user_text}]
        try:
            ids, dropped = build_prompt(self.tokenizer, self.system, messages, max_len - reserve)
        except InvalidRequestError as e:  # the template rejected the messages
            self.notice(f"error: {e}")
            return None
        if ids is None:
            self.notice(f"error: the message does not fit the context ({max_len} tokens with room for the reply)")
            return None
        if dropped:
            turns = sum(1 for m in messages[:dropped] if m["role"] == "user")
            self.notice(f"(the conversation is over the context of {max_len} tokens: "
                        f"dropped the oldest {turns} turn{'s' if turns != 1 else ''})")
            messages = messages[dropped:]
        params = dataclasses.replace(self.params, max_tokens=min(self.params.max_tokens or max_len, max_len - len(ids)))
        self._turns += 1
        rid = f"chat-{self._turns}"
        self.last_prompt_ids = ids
        t0 = time.perf_counter()
        try:
            engine.add_request({"prompt_token_ids": ids}, params, rid)
        except InvalidRequestError as e:
            self.notice(f"error: {e}")
            return None
        tracker = DeltaTracker(params.stop_strings)
        t_first = t_last = None
        n_tokens, text, interrupted = 0, "", False
        while True:
            if stop_flag is not None and stop_flag.is_set:
                engine.abort(rid)
                interrupted = True
                break
            final = None
            for out in engine.step():
                if out.request_id != rid:
                    continue
                for d in tracker.update(out):
                    if d.text:
                        self.out.write(d.text)
                        self.out.flush()
                        text += d.text
                c = out.outputs[0]
                if len(c.token_ids) > n_tokens:
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
                    n_tokens = len(c.token_ids)
                if out.finished:
                    final = out
            if final is not None or not engine.has_unfinished_requests():
                break
        self.out.write("\n")
        self.out.flush()
        self.notice(_status(n_tokens, t0, t_first, t_last, interrupted))
        if interrupted and not text:
            self.messages = messages[:-1]  # nothing said: forget the question too
            return text
        self.messages = messages + [{"role": "assistant", "content": text}]
        return text


def _status(n: int, t0: float, t_first: float | None, t_last: float | None, interrupted: bool) -> str:
    parts = [f"{n} token{'s' if n != 1 else ''}"]
    if n > 1 and t_first is not None and t_last > t_first:
        parts.append(f"{(n - 1) / (t_last - t_first):.1f} tok/s")  # decode rate, after the first token
    elif n == 1 and t_first is not None:
        parts.append(f"{1 / (t_first - t0):.1f} tok/s")
    if t_first is not None:
        parts.append(f"TTFT {t_first - t0:.2f} s")
    if interrupted:
        parts.append("interrupted")
    return "[" + ", ".join(parts) + "]"


class _Flag:
    is_set = False


@contextlib.contextmanager
def _sigint_sets_flag():
    """While a reply streams, Ctrl-C raises a flag checked between steps (never mid-step)."""
    flag = _Flag()

    def handler(signum, frame):
        flag.is_set = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: no Ctrl-C handling
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


# ------------------------------------------------------------------ the command
def _read_line(interactive: bool) -> str | None:
    """One line from the user; None at EOF."""
    if interactive:
        try:
            return input(">>> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def run_chat(ns: argparse.Namespace) -> int:
    from turbollm.engine.llm_engine import LLMEngine
    from turbollm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, seed=ns.seed)
    engine = LLMEngine.from_engine_args(engine_args_from(ns))
    if engine.tokenizer.chat_template is None:
        print(f"turbollm chat: {ns.model} has no chat template (a base model?); use `turbollm generate`",
              file=sys.stderr)
        return 1
    session = ChatSession(engine, params, ns.system)
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing and history for input()
        session.notice(f"turbollm chat with {ns.model} (context {engine.max_model_len} tokens). {HELP}; "
                       "Ctrl-C stops a reply.")
    while True:
        try:
            line = _read_line(interactive)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        if line is None:
            if interactive:
                print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd in ("/exit", "/quit"):
                return 0
            if cmd == "/reset":
                session.reset()
                session.notice("(history cleared)")
            elif cmd == "/system":
                session.system = arg.strip() or None
                session.notice(f"(system prompt set: {session.system!r})" if session.system
                               else "(system prompt cleared)")
            elif cmd == "/help":
                session.notice(HELP)
            else:
                session.notice(f"unknown command {cmd}; {HELP}")
            continue
        with _sigint_sets_flag() as flag:
            session.send(text, flag)
