"""Rank 0's reading of the torchrun ranks' heartbeats (engine/executor/heartbeat.py), on a store and a clock
of the test's: beats that stop name the rank; ranks still on the step that use no CPU time are stuck; a slow
rank that computes, or one that has finished the step and waits, is not."""

from __future__ import annotations

import time

import pytest

from turbollm.distributed.tensor_parallel import STEP_TIMEOUT_S
from turbollm.engine.executor import heartbeat
from turbollm.engine.executor.heartbeat import HangWatch, Heartbeat


class Store:
    def __init__(self):
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: now[0])
    return now


def _beat(store: Store, rank: int, beats: int, cpu: float, done: int) -> None:
    store.set(heartbeat._key(rank), f"{beats} {cpu} {done}")


def _watch(store: Store, ranks: int = 3) -> HangWatch:
    return HangWatch([("elsewhere", 1000 + r) for r in range(ranks)], store=store)


def _run(watch, store, clock, seconds: float, beat, own_busy=False) -> str | None:
    """Poll every half second for `seconds`, `beat(t)` writing the ranks' beats first; the first verdict."""
    t = 0.0
    while t <= seconds:
        beat(t)
        why = watch.hung(own_busy)
        if why is not None:
            return why
        clock[0] += 0.5
        t += 0.5
    return None


def test_beats_that_stop_name_the_rank(clock):
    store = Store()
    watch = _watch(store)
    watch.begin(7)

    def beat(t):
        _beat(store, 1, int(t) + 1, 1.0 + t, 6)  # computing step 7
        if t < 2:  # rank 2 stops after 2 s
            _beat(store, 2, int(t) + 1, 1.0 + t, 6)

    why = _run(watch, store, clock, 20, beat)
    assert why is not None and why.startswith("rank 2 (pid 1002 on elsewhere) stopped answering (hung): no heartbeat")
    assert clock[0] - 100 <= STEP_TIMEOUT_S + 2.5


def test_ranks_still_on_the_step_that_use_no_cpu_are_stuck(clock):
    store = Store()
    watch = _watch(store)
    watch.begin(7)

    def beat(t):  # both beat (their threads run), rank 1 has answered, rank 2 sleeps on the step
        _beat(store, 1, int(t) + 1, 5.0, 7)
        _beat(store, 2, int(t) + 1, 3.0 + 0.001 * t, 6)

    why = _run(watch, store, clock, 20, beat)
    assert why is not None and why.startswith("rank 2 (pid 1002 on elsewhere) stopped answering (hung): the ranks")
    assert STEP_TIMEOUT_S <= clock[0] - 100 <= STEP_TIMEOUT_S + 1


def test_rank_0s_own_part_counts_among_the_silent(clock, monkeypatch):
    store = Store()
    watch = _watch(store, ranks=2)
    watch.begin(3)
    monkeypatch.setattr(heartbeat, "process_cpu_s", lambda: 50.0)  # rank 0's own part sleeps too

    def beat(t):
        _beat(store, 1, int(t) + 1, 2.0, 2)

    why = _run(watch, store, clock, 20, beat, own_busy=True)
    assert why is not None and "or one of rank 1" in why and why.startswith("rank 0 ")


def test_a_slow_rank_that_computes_or_one_that_waits_after_its_answer_is_not_hung(clock):
    store = Store()
    watch = _watch(store)
    watch.begin(7)

    def beat(t):
        _beat(store, 1, int(t) + 1, 1.0, 7)  # answered long ago, sleeping in the gather
        _beat(store, 2, int(t) + 1, 1.0 + 0.9 * t, 6)  # a long prefill on a slow host

    assert _run(watch, store, clock, 60, beat) is None


def test_a_heartbeat_writes_its_first_beat_at_once_and_says_when_a_step_is_done():
    store = Store()
    beat = Heartbeat(4, store=store)
    beats, _, done = store.get(heartbeat._key(4)).decode().split()
    assert int(beats) >= 1 and int(done) == -1
    beat.done(9)
    for _ in range(200):  # the thread writes it at once (well before its next beat)
        if store.get(heartbeat._key(4)).decode().split()[2] == "9":
            break
        time.sleep(0.005)
    assert store.get(heartbeat._key(4)).decode().split()[2] == "9"
