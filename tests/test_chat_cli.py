"""`turbollm chat`: the command driven through stdin, and the conversation prompt it builds."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import catalog_model_path
from turbollm import LLM, SamplingParams
from turbollm.cli.chat_cmd import ChatSession, build_prompt, render_conversation

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]
STATUS = re.compile(r"^\[(\d+) tokens?, [\d.]+ tok/s, TTFT [\d.]+ s\]$", re.M)
GREEDY8 = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def model_path():
    return str(catalog_model_path("smollm2-135m"))


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, threads=1, kv_cache_memory=64 << 20)


def _reply(llm, messages, params=GREEDY8):
    return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def test_chat_command_through_stdin(llm, model_path):
    proc = subprocess.run(
        [sys.executable, "-m", "turbollm", "chat", "--model", model_path, "--threads", "1", "--temperature", "0",
         "--max-tokens", "8", "--kv-cache-memory", "0.0625"],
        input="hello\n/reset\nhi again\n/exit\n", capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    # stdout carries exactly the replies; after /reset the second turn starts a new conversation
    expected = [_reply(llm, [{"role": "user", "content": "hello"}]),
                _reply(llm, [{"role": "user", "content": "hi again"}])]
    assert all(expected)
    assert proc.stdout == "".join(r + "\n" for r in expected)
    statuses = STATUS.findall(proc.stderr)
    assert len(statuses) == 2 and all(1 <= int(n) <= 8 for n in statuses), proc.stderr
    assert "history cleared" in proc.stderr


def test_chat_in_process_eof_and_commands(llm, monkeypatch, capsys):
    from turbollm.cli.main import main

    monkeypatch.setattr("turbollm.engine.llm_engine.LLMEngine.from_engine_args", lambda args: llm.engine)  # reuse the loaded model
    monkeypatch.setattr(sys, "stdin", io.StringIO("/nonsense\n/system Be a pirate.\n\nhello\n"))  # then EOF
    assert main(["chat", "--temperature", "0", "--max-tokens", "4"]) == 0
    cap = capsys.readouterr()
    reply = _reply(llm, [{"role": "system", "content": "Be a pirate."}, {"role": "user", "content": "hello"}],
                   SamplingParams(temperature=0, max_tokens=4))
    assert cap.out == reply + "\n"
    assert "unknown command /nonsense" in cap.err and "system prompt set" in cap.err
    assert len(STATUS.findall(cap.err)) == 1


def test_prompt_holds_the_whole_conversation(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada!"},
                {"role": "user", "content": "What is my name?"}]
    ids, dropped = build_prompt(tok, "Be brief.", messages, 10_000)
    assert dropped == 0 and ids == render_conversation(tok, "Be brief.", messages)
    text = tok.decode(ids)
    order = [text.index(s) for s in ("Be brief.", "My name is Ada.", "Hello Ada!", "What is my name?")]
    assert order == sorted(order)
    assert text.endswith(tok.apply_chat_template([{"role": "user", "content": "x"}])[-20:])  # generation prompt

    # too long: the oldest turn goes, the system prompt stays
    last_only = render_conversation(tok, "Be brief.", messages[2:])
    ids, dropped = build_prompt(tok, "Be brief.", messages, len(last_only))
    assert dropped == 2 and ids == last_only
    assert build_prompt(tok, "Be brief.", messages, len(last_only) - 1) == (None, 2)


def test_session_second_turn_sees_the_first(llm):
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(llm.engine, GREEDY8, out=out, err=err)
    r1 = session.send("hello")
    first_prompt = session.last_prompt_ids
    r2 = session.send("What did I just say?")
    tok = llm.get_tokenizer()
    second = tok.decode(session.last_prompt_ids)
    assert r1 and second.index("hello") < second.index(r1) < second.index("What did I just say?")
    assert session.last_prompt_ids[:len(first_prompt)] == first_prompt  # the first turn is a prefix
    assert r1 == _reply(llm, [{"role": "user", "content": "hello"}])
    assert out.getvalue() == f"{r1}\n{r2}\n"
    assert len(STATUS.findall(err.getvalue())) == 2
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2
    assert llm.engine.kv_manager.num_used == 0


def test_session_drops_oldest_turns_and_stops_on_flag(llm, monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(llm.engine, GREEDY8, system="You are terse.", out=out, err=err)
    monkeypatch.setattr(llm.engine, "max_model_len", 90)
    for q in ["hello there", "how are you?", "tell me a joke", "another one"]:
        session.send(q)
    assert "dropped the oldest" in err.getvalue()
    text = llm.get_tokenizer().decode(session.last_prompt_ids)
    assert "You are terse." in text and "hello there" not in text and "another one" in text
    assert len(session.last_prompt_ids) <= 90 - 8

    class StopAfter:  # Ctrl-C pressed after the first token
        def __init__(self):
            self.checks = 0

        @property
        def is_set(self):
            self.checks += 1
            return self.checks > 3

    monkeypatch.undo()
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    session = ChatSession(llm.engine, long, out=io.StringIO(), err=err)
    reply = session.send("Count from one to one hundred.", StopAfter())
    assert "interrupted" in err.getvalue().splitlines()[-1]
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_manager.num_used == 0
    assert len(llm.get_tokenizer().encode(reply, add_special_tokens=False)) < 10
    assert session.messages[-1] == {"role": "assistant", "content": reply} if reply else session.messages == []
