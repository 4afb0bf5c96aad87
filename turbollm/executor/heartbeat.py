"""Heartbeats of the ranks torchrun started (executor/torchrun.py): how rank 0, on whatever host, tells
within 10 s a rank that hangs from one that is slow, and which rank is gone when a collective with them fails.

Every rank but 0 runs a `Heartbeat`: a daemon thread that writes "beats cpu-seconds step-done state" under
its key in torchrun's store (a TCPStore client of its own at MASTER_ADDR:MASTER_PORT) every `BEAT_S`,
and at once when the rank has finished a step or seen a collective fail (state "lost"). While a step is
out, rank 0 reads them (`HangWatch`, every `POLL_S`):
- a rank whose beats stop for `STEP_TIMEOUT_S` is stopped or frozen (SIGSTOP, a paused machine; our kernels
  and torch's ops let go of Python's lock, so a long call does not stop the beats, and no Python code of a
  step holds it for seconds);
- the ranks that have not finished the step (rank 0 among them while its own part runs) are stuck when
  together they used less than `ACTIVE_CPU_S` of CPU time in `STEP_TIMEOUT_S`: ranks waiting for each other
  sleep (a deadlock, or pipeline stages behind one that hangs), as the multi-process executor's `_Stall`
  judges from /proc;
- a rank that dies is found sooner, as its connections close; `HangWatch.gone` then names the ranks whose
  beats stopped without their saying they saw the others fail (a rank torchrun's agent killed because
  another rank of its node failed is gone too, and named).
What no beat tells: a rank that spins (uses CPU without ever finishing the step) looks like a slow one, and
the gathers' own timeout (`REPLY_TIMEOUT`, distributed/launch.py) ends the wait; start-up (the ranks loading
their weights) is judged by that timeout too.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from turbollm.distributed.tensor_parallel import ACTIVE_CPU_S, STEP_TIMEOUT_S
from turbollm.procfs import pid_alive, proc_exiting, proc_state

BEAT_S = 1.0
POLL_S = 0.5
STORE_TIMEOUT_S = 10  # one read or write of the store
REOPEN_AFTER = 3  # failed writes in a row before a new client of the store


@dataclass(frozen=True)
class Whereabouts:
    """Where a rank runs: its host's name and pid, and `space` (the boot and pid namespace), which tells
    whether its pid means a process of this one's machine (host names alone may repeat across containers)."""

    host: str
    pid: int
    space: str

    @property
    def local(self) -> bool:
        return self.space == _pid_space()

    def ended(self) -> bool:
        """Whether this is a process of this machine that has ended or is ending (killed: it may hold its
        sockets open a while longer); False for one elsewhere (rank 0 cannot tell)."""
        return self.local and (not pid_alive(self.pid) or proc_exiting(self.pid))

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}"


@functools.cache
def _pid_space() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # no /proc: the host's name is all there is
        return socket.gethostname()


def whereabouts() -> Whereabouts:
    """This process's."""
    return Whereabouts(socket.gethostname(), os.getpid(), _pid_space())


def open_store() -> dist.TCPStore:
    """A client of torchrun's store (its agent's, at MASTER_ADDR:MASTER_PORT), for one thread."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))


def _key(rank: int) -> str:
    return f"turbollm/heartbeat/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{rank}"


def process_cpu_s() -> float:
    """User + system CPU time of this process (all its threads), in seconds."""
    t = os.times()
    return t.user + t.system


class Heartbeat:
    """A worker rank's beats (the first written before the constructor returns, so rank 0 finds the key)."""

    def __init__(self, rank: int, store=None):
        self._own_store = store is None
        self._store = store if store is not None else open_store()
        self._key, self._beats, self._done, self._state = _key(rank), 0, -1, "ok"
        self._wake, self._stop, self._written = threading.Event(), threading.Event(), threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._run, name="turbollm-heartbeat", daemon=True)
        self._thread.start()

    def done(self, step: int) -> None:
        """This rank has finished step `step` (its reply goes to rank 0 next): said at once."""
        self._done = step
        self._wake.set()

    def lost(self, wait_s: float = 2 * BEAT_S) -> None:
        """A collective with the other ranks failed here: said before this rank stops (waits up to `wait_s`)."""
        self._state = "lost"
        self._wake.set()
        self._written.wait(wait_s)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()

    def _write(self) -> None:
        self._beats += 1
        state = self._state
        self._store.set(self._key, f"{self._beats} {process_cpu_s():.3f} {self._done} {state}")
        if state == "lost":
            self._written.set()

    def _run(self) -> None:
        failed = 0
        while not self._stop.is_set():
            self._wake.wait(BEAT_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._write()
                failed = 0
            except Exception:  # noqa: BLE001 - the store is busy or gone (then so is rank 0: the collectives say so)
                failed += 1  # tried again at the next beat (a wait longer than STEP_TIMEOUT_S would read as a hang)
                if self._own_store and failed % REOPEN_AFTER == 0:
                    try:
                        self._store = open_store()
                    except Exception:  # noqa: BLE001 - tried again later
                        pass


class HangWatch:
    """Rank 0's reading of the other ranks' beats while a step is out. `where[r]` = rank r's whereabouts."""

    def __init__(self, where: list[Whereabouts], store=None, clock=time.monotonic, sleep=time.sleep):
        self._store = store if store is not None else open_store()
        self._where = where
        self._clock, self._sleep = clock, sleep
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beats, when that count was first read)
        self._base: dict[int, float] = {}
        self._step, self._since = -1, 0.0

    def begin(self, step: int) -> None:
        """Step `step` (rank 0's count of messages sent to the ranks) is out."""
        self._step, self._seen, self._base, self._since = step, {}, {}, self._clock()

    def _read(self) -> dict[int, tuple[int, float, int, str]]:
        beats = {}
        for r in range(1, len(self._where)):
            try:
                b, cpu, done, state = self._store.get(_key(r)).decode().split()
            except Exception:  # noqa: BLE001 - unreadable now (the store is busy or gone): no verdict on it
                continue
            beats[r] = (int(b), float(cpu), int(done), state)
        return beats

    def hung(self, own_cpu: float | None) -> str | None:
        """Why the step is stuck, naming the rank (None: it is not, as far as the beats tell). `own_cpu`: the CPU
        seconds rank 0's own part has used, while it runs (None once it is done)."""
        now = self._clock()
        beats = self._read()
        for r, (b, _, _, state) in beats.items():
            seen = self._seen.get(r)
            if seen is None or seen[0] != b:
                self._seen[r] = (b, now)
            elif now - seen[1] > STEP_TIMEOUT_S and state != "lost":  # "lost": it saw another rank fail and ends
                return f"{self.name(r)} {self._silence(r)}: no heartbeat for {now - seen[1]:.0f} s{self._stopped(r)}"
        silent = {r: cpu for r, (_, cpu, done, _) in beats.items() if done < self._step}
        if own_cpu is not None:
            silent[0] = own_cpu
        used = sum(cpu - self._base.get(r, cpu) for r, cpu in silent.items())
        if not self._base or used >= ACTIVE_CPU_S:
            self._base, self._since = silent, now
        if silent and now - self._since > STEP_TIMEOUT_S:
            ranks = sorted(silent, key=lambda r: (r == 0, r))  # a worker first: rank 0 waits on them more often
            others = f" (or one of {', '.join(self.name(r) for r in ranks[1:])}, which wait on each other)" \
                if len(ranks) > 1 else ""
            return (f"{self.name(ranks[0])} stopped answering (hung): the ranks that have not finished the step used "
                    f"no CPU time for {now - self._since:.0f} s{others}")
        return None

    def gone(self, wait_s: float = 2 * BEAT_S + POLL_S) -> list[int]:
        """After a collective failed: the ranks whose beats stopped without their saying they saw the others fail
        (read for `wait_s`, long enough for every live rank to beat at least once)."""
        first = self._read()
        end = self._clock() + wait_s
        quiet = {r for r, (_, _, _, state) in first.items() if state != "lost"}
        while quiet and self._clock() < end:
            self._sleep(POLL_S)
            now = self._read()
            quiet = {r for r in quiet if r in now and now[r][0] == first[r][0] and now[r][3] != "lost"}
        return sorted(quiet)

    def name(self, rank: int) -> str:
        return f"rank {rank} ({self._where[rank]})"

    def _silence(self, rank: int) -> str:
        """A rank on this machine whose process has ended, or is ending (killed, its sockets not yet closed), is
        gone; else it hangs, as far as rank 0 can tell."""
        return "is gone" if self._where[rank].ended() else "stopped answering (hung)"

    def _stopped(self, rank: int) -> str:
        w = self._where[rank]
        return " (its process is stopped)" if w.local and proc_state(w.pid) in ("T", "t") else ""
