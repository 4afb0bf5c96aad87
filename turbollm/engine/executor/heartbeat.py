"""Heartbeats of the ranks torchrun started (engine/executor/torchrun.py): how rank 0, on whatever host, tells
within 10 s a rank that hangs from one that is slow.

Every rank but 0 runs a `Heartbeat`: a daemon thread that writes "beats cpu-seconds step-done" under
its key in torchrun's store (a TCPStore client of its own at MASTER_ADDR:MASTER_PORT) every `BEAT_S`,
and at once when the rank has finished a step. While a step is out, rank 0 reads them (`HangWatch`,
every `POLL_S` after the step's first): a rank whose beats stop for `STEP_TIMEOUT_S` is stopped or frozen
(SIGSTOP, a paused machine, or a call that holds Python's lock that long: none of ours does, the fused
step lets go of it); and the ranks that have not finished the step (rank 0 among them while its own part
runs) are stuck when together they used less than `ACTIVE_CPU_S` of CPU time in `STEP_TIMEOUT_S`: ranks
waiting for each other sleep (a deadlock, or pipeline stages behind one that hangs), as the multi-process
executor's `_Stall` judges from /proc. A rank that dies is found sooner: its connections close.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import torch.distributed as dist

from turbollm.distributed.tensor_parallel import ACTIVE_CPU_S, STEP_TIMEOUT_S
from turbollm.procfs import proc_state

BEAT_S = 1.0
POLL_S = 0.5
STORE_TIMEOUT_S = 10  # one read or write of the store


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
        self._store = store if store is not None else open_store()
        self._key, self._beats, self._done = _key(rank), 0, -1
        self._wake = threading.Event()
        self._write()
        threading.Thread(target=self._run, name="turbollm-heartbeat", daemon=True).start()

    def done(self, step: int) -> None:
        """This rank has finished step `step` (its reply goes to rank 0 next): said at once."""
        self._done = step
        self._wake.set()

    def _write(self) -> None:
        self._beats += 1
        self._store.set(self._key, f"{self._beats} {process_cpu_s():.3f} {self._done}")

    def _run(self) -> None:
        while True:
            self._wake.wait(BEAT_S)
            self._wake.clear()
            try:
                self._write()
            except Exception:  # noqa: BLE001 - the store is gone (rank 0's node is): the collectives say so
                return


class HangWatch:
    """Rank 0's reading of the other ranks' beats while a step is out. `where[r]` = rank r's (host, pid)."""

    def __init__(self, where: list[tuple[str, int]], store=None):
        self._store = store if store is not None else open_store()
        self._where = where
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beats, when that count was first read)
        self._base: dict[int, float] = {}
        self._step, self._since = -1, 0.0

    def begin(self, step: int) -> None:
        """Step `step` (rank 0's count of messages sent to the ranks) is out."""
        self._step, self._seen, self._base, self._since = step, {}, {}, time.monotonic()

    def _read(self) -> dict[int, tuple[int, float, int]]:
        beats = {}
        for r in range(1, len(self._where)):
            try:
                b, cpu, done = self._store.get(_key(r)).decode().split()
            except Exception:  # noqa: BLE001 - unreadable now (the store is busy or gone): no verdict on it
                continue
            beats[r] = (int(b), float(cpu), int(done))
        return beats

    def hung(self, own_busy: bool) -> str | None:
        """Why the step is stuck, naming the rank (None: it is not, as far as the beats tell)."""
        now = time.monotonic()
        beats = self._read()
        for r, (b, _, _) in beats.items():
            seen = self._seen.get(r)
            if seen is None or seen[0] != b:
                self._seen[r] = (b, now)
            elif now - seen[1] > STEP_TIMEOUT_S:
                return (f"{self.name(r)} stopped answering (hung): no heartbeat for {now - seen[1]:.0f} s"
                        f"{self._stopped(r)}")
        silent = {r: cpu for r, (_, cpu, done) in beats.items() if done < self._step}
        if own_busy:
            silent[0] = process_cpu_s()
        used = sum(cpu - self._base.get(r, cpu) for r, cpu in silent.items())
        if not self._base or used >= ACTIVE_CPU_S:
            self._base, self._since = silent, now
        if silent and now - self._since > STEP_TIMEOUT_S:
            ranks = sorted(silent)
            others = f" (or one of {', '.join(self.name(r) for r in ranks[1:])}, which wait on each other)" \
                if len(ranks) > 1 else ""
            return (f"{self.name(ranks[0])} stopped answering (hung): the ranks that have not finished the step used "
                    f"no CPU time for {now - self._since:.0f} s{others}")
        return None

    def name(self, rank: int) -> str:
        host, pid = self._where[rank]
        return f"rank {rank} (pid {pid} on {host})"

    def _stopped(self, rank: int) -> str:
        host, pid = self._where[rank]
        return " (its process is stopped)" if host == socket.gethostname() and proc_state(pid) in ("T", "t") else ""
