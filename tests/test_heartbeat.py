"""Rank 0's reading of the torchrun ranks' heartbeats (executor/heartbeat.py), on a store and a clock
of the test's: beats that stop name the rank; ranks still on the step that use no CPU time are stuck; a slow
rank that computes, or one that has finished the step and waits, is not; after a collective failed, the rank
whose beats stopped without its saying so is the one gone."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from turbollm.distributed.tensor_parallel import STEP_TIMEOUT_S
from turbollm.executor import heartbeat
from turbollm.executor.heartbeat import HangWatch, Heartbeat, Whereabouts, whereabouts


class Store:
    def __init__(self):
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]


@pytest.fixture
def clock():
    return [100.0]


def _beat(store: Store, rank: int, beats: int, cpu: float, done: int, state: str = "ok") -> None:
    store.set(heartbeat._key(rank), f"{beats} {cpu} {done} {state}")


def _no_sleep(seconds: float) -> None:
    raise AssertionError("HangWatch.hung must not sleep")


def _watch(store: Store, clock, ranks: int = 3, sleep=_no_sleep) -> HangWatch:
    return HangWatch([Whereabouts("elsewhere", 1000 + r, "another machine") for r in range(ranks)], store=store,
                     clock=lambda: clock[0], sleep=sleep)


def _run(watch, store, clock, seconds: float, beat, own_cpu=lambda t: None) -> str | None:
    """Poll every half second for `seconds`, `beat(t)` writing the ranks' beats first; the first verdict."""
    t = 0.0
    while t <= seconds:
        beat(t)
        why = watch.hung(own_cpu(t))
        if why is not None:
            return why
        clock[0] += 0.5
        t += 0.5
    return None


def test_beats_that_stop_name_the_rank(clock):
    store = Store()
    watch = _watch(store, clock)
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
    watch = _watch(store, clock)
    watch.begin(7)

    def beat(t):  # both beat (their threads run), rank 1 has answered, rank 2 sleeps on the step
        _beat(store, 1, int(t) + 1, 5.0, 7)
        _beat(store, 2, int(t) + 1, 3.0 + 0.001 * t, 6)

    why = _run(watch, store, clock, 20, beat)
    assert why is not None and why.startswith("rank 2 (pid 1002 on elsewhere) stopped answering (hung): the ranks")
    assert STEP_TIMEOUT_S <= clock[0] - 100 <= STEP_TIMEOUT_S + 1


def _stage_1_waits(store):
    def beat(t):  # rank 1 (the last pipeline stage) waits for rank 0's hidden states: it beats, uses no CPU
        _beat(store, 1, int(t) + 1, 2.0, 2)
    return beat


def test_rank_0s_own_part_counts_among_the_silent(clock):
    store = Store()
    watch = _watch(store, clock, ranks=2)
    watch.begin(3)
    why = _run(watch, store, clock, 20, _stage_1_waits(store), own_cpu=lambda t: 50.0)  # rank 0's part sleeps too
    assert why is not None and why.startswith("rank 1 (pid 1001 on elsewhere) stopped answering (hung)")
    assert "or one of rank 0 (pid 1000 on elsewhere)" in why


def test_rank_0_computing_its_own_part_keeps_the_step_alive(clock):
    store = Store()
    watch = _watch(store, clock, ranks=2)
    watch.begin(3)
    assert _run(watch, store, clock, 60, _stage_1_waits(store), own_cpu=lambda t: 50.0 + 0.9 * t) is None


def test_rank_0_done_with_its_part_is_not_counted(clock):
    store = Store()
    watch = _watch(store, clock, ranks=2)
    watch.begin(3)
    why = _run(watch, store, clock, 20, _stage_1_waits(store))  # own_cpu None: rank 0 waits in the gather
    assert why is not None and why.startswith("rank 1 ") and "or one of" not in why


def test_a_slow_rank_that_computes_or_one_that_waits_after_its_answer_is_not_hung(clock):
    store = Store()
    watch = _watch(store, clock)
    watch.begin(7)

    def beat(t):
        _beat(store, 1, int(t) + 1, 1.0, 7)  # answered long ago, sleeping in the gather
        _beat(store, 2, int(t) + 1, 1.0 + 0.9 * t, 6)  # a long prefill on a slow host

    assert _run(watch, store, clock, 60, beat) is None


def test_after_a_failed_collective_the_rank_whose_beats_stopped_unannounced_is_gone(clock):
    store = Store()
    _beat(store, 1, 10, 1.0, 5)
    _beat(store, 2, 10, 1.0, 5)  # killed: its beats stop as they were
    _beat(store, 3, 10, 1.0, 5)
    _beat(store, 4, 12, 1.0, 5, "lost")  # saw the collective fail before rank 0 did, and ended: beats frozen

    def sleep(s):  # rank 1 saw it fail too (and ends), rank 3 is still computing
        clock[0] += s
        _beat(store, 1, 11, 1.0, 5, "lost")
        _beat(store, 3, 10 + int(clock[0] - 100) + 1, 1.0, 5)

    watch = _watch(store, clock, ranks=5, sleep=sleep)
    assert watch.gone() == [2]
    assert clock[0] - 100 <= 2 * heartbeat.BEAT_S + heartbeat.POLL_S + 0.01


def test_a_rank_that_said_lost_is_not_named_as_hung(clock):
    store = Store()
    watch = _watch(store, clock)
    watch.begin(7)

    def beat(t):  # rank 1 ended after a failed collective (its last beat says so); rank 2 stops beating later
        _beat(store, 1, 3, 1.0, 6, "lost")
        _beat(store, 2, min(int(t), 3) + 1, 1.0 + t, 6)

    why = _run(watch, store, clock, 20, beat)
    assert why is not None and why.startswith("rank 2 ") and "no heartbeat" in why


class FlakyStore(Store):
    def __init__(self, failures: int):
        super().__init__()
        self.failures = failures

    def set(self, key: str, value: str) -> None:
        if self.failures > 0 and "lost" not in value and value.split()[0] != "1":
            self.failures -= 1
            raise RuntimeError("the store is busy")
        super().set(key, value)


def _field(store: Store, rank: int, i: int) -> str:
    return store.get(heartbeat._key(rank)).decode().split()[i]


def _until(cond, seconds: float = 2.0) -> bool:
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


def test_a_heartbeat_writes_its_first_beat_at_once_and_says_when_a_step_is_done_or_lost():
    store = Store()
    beat = Heartbeat(4, store=store)
    try:
        assert int(_field(store, 4, 0)) >= 1 and _field(store, 4, 2) == "-1" and _field(store, 4, 3) == "ok"
        beat.done(9)
        assert _until(lambda: _field(store, 4, 2) == "9")  # at once, well before the next beat
        beat.lost(wait_s=10)  # returns once written
        assert _field(store, 4, 3) == "lost"
    finally:
        beat.stop()


def test_a_heartbeat_goes_on_after_the_store_fails_a_write():
    store = FlakyStore(failures=1)
    beat = Heartbeat(5, store=store)
    try:
        beat.done(3)  # this write fails; the next, at the next beat (a second later), goes through
        assert _until(lambda: _field(store, 5, 2) == "3", seconds=4.0)
    finally:
        beat.stop()


def test_whereabouts_tell_this_machine_from_another_of_the_same_name():
    here = whereabouts()
    assert here.local and here.pid == os.getpid()
    assert not Whereabouts(here.host, here.pid, "another machine").local


def test_beats_that_stop_because_the_process_on_this_machine_ended_say_it_is_gone(clock):
    """A killed rank may keep its sockets open while its memory is released (gloo sees nothing yet): its beats
    have stopped, and its process on this machine has ended or is ending."""
    dead = subprocess.Popen(["sleep", "60"])
    try:
        dead.kill()
        os.waitid(os.P_PID, dead.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped (a zombie): its pid still names it
        here = whereabouts()
        store = Store()
        watch = HangWatch([here, Whereabouts(here.host, dead.pid, here.space)], store=store,
                          clock=lambda: clock[0], sleep=_no_sleep)
        watch.begin(3)
        why = _run(watch, store, clock, 20, lambda t: _beat(store, 1, 5, 1.0, 2))
        assert why is not None and why.startswith(f"rank 1 (pid {dead.pid} on {here.host}) is gone: no heartbeat"), why
    finally:
        dead.wait()
