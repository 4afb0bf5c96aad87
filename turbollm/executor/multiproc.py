"""Worker processes (spawned, so they share no threads or locks with the engine), each reached through
a pipe: the step's `SchedulerOutput` goes over pickled, the `ModelRunnerOutput` comes back, both
tagged with the step's number. One worker, or with `tensor_parallel_size` N × `pipeline_parallel_size`
M > 1 one per rank: the ranks join a gloo group at a free local port the engine picked
(`distributed/tensor_parallel.py`), every rank runs every step, and the first rank of the last
pipeline stage gives the step's output (the other ranks of that stage sample too, and their tokens
are checked against it: the ranks must agree; earlier stages sample nothing).

The engine's process never loads the weights: the workers do, and the engine keeps only the
model's config and tokenizer. A worker that raises during a step sends the traceback back (the
engine raises `ExecutorError` with it and the worker keeps serving; with several ranks, which are then out
of step, the error is a fatal `WorkerDiedError`); a worker that dies is noticed
within `POLL_S` seconds of the engine waiting on any worker and reported with its rank and exit
code (`WorkerDiedError`: the engine cannot go on). A hung rank is named once its peers' collectives
time out, or, with pipeline stages (which wait on each other for as long as a stage computes), once
no rank still working has used CPU time for `STEP_TIMEOUT_S` (`_Stall`). A reply the engine stopped waiting for (Ctrl-C
while a step ran) is recognised by its number and dropped. Workers ignore SIGINT: Ctrl-C in a
terminal reaches the whole process group, and it is the engine's to handle.

Pipeline stages take several steps at once (`max_steps_in_flight`: `submit` sends a step, `collect` waits
for the oldest one's replies; replies to a later step that come first are kept in `_early`). Each worker
reads its pipe in a thread (`_read`), so the engine's send of step k + 1 never waits for step k to end,
and shows each step to the worker as it comes (`Worker.queued`: the tied table's lookups start at once).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import queue
import random
import signal
import socket
import threading
import time
import traceback
import weakref
from collections import deque

from turbollm.distributed.shm_comm import ShmFiles
from turbollm.distributed.tensor_parallel import ACTIVE_CPU_S, STEP_TIMEOUT_S
from turbollm.executor.base import Executor, ExecutorError, WorkerDiedError
from turbollm.gc_heap import freeze_startup_heap
from turbollm.handoff.runner_output import ModelRunnerOutput
from turbollm.handoff.scheduler_output import SchedulerOutput
from turbollm.procfs import CLOCK_TICKS, cpu_ticks, proc_state

logger = logging.getLogger("turbollm")
POLL_S = 1.0
HANG_GRACE_S = 2.0  # after a rank fails a step's collectives, how long the others may take to answer


def _worker_main(conn, config, kv_config, rank=0, init_method=None, sampler_seed=None, shm_files=None,
                 draft_kv_config=None) -> None:
    """The worker process: build the worker, then run steps until told to stop or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from turbollm.worker.worker import Worker

        worker = Worker(config, kv_config, rank=rank, init_method=init_method, sampler_seed=sampler_seed,
                        shm_files=shm_files, draft_kv_config=draft_kv_config)
    except BaseException:  # noqa: BLE001 - reported to the engine, which raises it
        conn.send(("error", 0, traceback.format_exc()))
        return
    freeze_startup_heap()  # this process is the worker's alone: full GC passes skip its start-up objects
    conn.send(("ready", 0, worker.footprint()))
    try:
        _serve(conn, worker)
    finally:
        worker.close()  # (a KV connector's writes finish first)
        import torch.distributed as dist

        if dist.is_initialized():  # leave the tensor-parallel group cleanly (its threads stop)
            dist.destroy_process_group()


def _read(conn, inbox: queue.Queue, closed: threading.Event, worker) -> None:
    """The worker's reader thread: every message into `inbox` as it comes, so the engine's sends never wait
    for a step to end (with steps in flight it sends the next while this worker runs one); a step is shown
    to the worker first (`Worker.queued`: a pipeline stage may start on it). The pipe closing (the engine is
    gone) sets `closed`: the steps still queued are not run."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            closed.set()
            inbox.put(("shutdown",))
            return
        except BaseException:  # noqa: BLE001 - a message that does not unpickle: say so, keep serving
            inbox.put(("unreadable", -1, traceback.format_exc()))
            continue
        if msg[0] == "execute":
            worker.queued(msg[2])
        inbox.put(msg)


def _serve(conn, worker) -> None:
    inbox: queue.Queue = queue.Queue()
    closed = threading.Event()
    threading.Thread(target=_read, args=(conn, inbox, closed, worker), name="turbollm-worker-reader",
                     daemon=True).start()
    while True:
        msg = inbox.get()
        if msg[0] == "shutdown" or closed.is_set():
            return
        if msg[0] == "unreadable":
            reply = ("error", -1, msg[2])
        else:
            try:
                if msg[0] == "call":  # a worker method by name (tests and benchmarks read per-rank state)
                    reply = ("ok", msg[1], getattr(worker, msg[2])())
                else:
                    reply = ("ok", msg[1], worker.execute_model(msg[2]))
            except Exception:  # noqa: BLE001 - this step failed; the worker keeps serving
                reply = ("error", msg[1], traceback.format_exc())
        try:
            conn.send(reply)
        except (OSError, ValueError):  # the engine is gone
            return


def _stop(procs, conns, shm=None) -> None:
    for files in shm or ():
        files.unlink()
    for conn in conns:
        try:
            conn.send(("shutdown",))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on now (rank 0's rendezvous; `serve --disaggregate`'s
    instances)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config, kv_config, loaded=None, draft_kv_config=None):
        super().__init__(config, kv_config, loaded, draft_kv_config)
        par = config.parallel
        ctx = mp.get_context("spawn")
        n, tp = par.world_size, par.tensor_parallel_size
        # the ranks' rendezvous (a free local port) and their samplers' common seed
        init_method = f"tcp://127.0.0.1:{free_port()}" if n > 1 else None
        seed = config.model.seed
        seed = seed if seed is not None or n == 1 else random.SystemRandom().getrandbits(62)
        # one shared-memory exchange per pipeline stage's tensor-parallel group
        shm = [ShmFiles.create(tp) for _ in range(par.pipeline_parallel_size)] \
            if tp > 1 and par.tp_shared_memory else None
        self._tp = tp
        self._last_stage = range(par.output_rank, n)  # the ranks that sample: the step's output is the first one's
        self._procs, self._conns = [], []
        for rank in range(n):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"turbollm-worker-{rank}", daemon=True,
                               args=(child, self.workers_config, kv_config, rank, init_method, seed, shm, draft_kv_config))
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(conn)
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, shm)
        self._step = 0
        self._broken: str | None = None  # several ranks: why they can no longer run steps together
        # pipeline stages run steps in flight: stage 0 takes step k + 1 while the later stages finish step k
        self.max_steps_in_flight = par.pp_steps_in_flight or par.pipeline_parallel_size
        self._in_flight: deque[int] = deque()  # the numbers of the steps sent and not collected, oldest first
        self._early: dict[int, dict[int, tuple]] = {}  # replies to a step in flight, come while waiting on an older one
        try:
            replies = self._gather("starting", 0, startup=True)
        except ExecutorError as e:  # a worker that said why (ExecutorError), or died without a word
            self.shutdown()
            if not isinstance(e, WorkerDiedError):
                raise
            raise WorkerDiedError(f"{e}; a script that starts an engine with worker processes needs "
                                  "`if __name__ == '__main__':` around its top level (multiprocessing's "
                                  "spawn re-imports it)") from None
        self._set_footprints([r[2] for r in replies], tp)
        for files in shm or ():  # every rank has mapped them
            files.unlink()

    def _dead(self, rank: int, doing: str) -> ExecutorError:
        """The error for a worker found gone: `WorkerDiedError`, with what it said before it went; at start-up,
        a worker that said why it could not start is an `ExecutorError` with its traceback."""
        proc, conn = self._procs[rank], self._conns[rank]
        proc.join(timeout=1)
        said = ""
        try:
            while conn.poll(0):
                kind, _, payload = conn.recv()
                if kind == "error":
                    if doing == "starting":
                        return _start_failure(rank, payload)
                    said = f":\n{payload}"
        except (EOFError, OSError):
            pass
        code = proc.exitcode
        how = ("is still running" if code is None else
               f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
        return WorkerDiedError(f"worker {rank} (pid {proc.pid}) {how} while {doing}{said}")

    def _gather(self, doing: str, step: int, startup: bool = False) -> list:
        """Every worker's reply to `step`, in rank order; any worker found dead ends the wait
        (`WorkerDiedError`). With several ranks, once one has answered the others get a deadline: a rank
        whose collectives timed out (a peer died or hangs) reports it after `STEP_TIMEOUT_S`, so the
        silent one is named as hung `HANG_GRACE_S` later; after any other answer the silent ranks get
        both (they finish the same step's work). Start-up has no deadline (ranks load at their pace)."""
        # (replies of earlier stages, come while the engine waited on a step before)
        replies: dict[int, tuple] = self._early.pop(step, {})
        deadline = min((d for r, (k, _, p) in replies.items() if (d := self._answer_deadline(r, k, p)) is not None),
                       default=None)
        stall = _Stall(self._procs) if not startup and len(self._conns) > self._tp else None
        while len(replies) < len(self._conns):
            waiting = [r for r in range(len(self._conns)) if r not in replies]
            ready = mp_connection.wait([self._conns[r] for r in waiting], timeout=POLL_S)
            for conn in ready:
                rank = self._conns.index(conn)
                try:
                    kind, tag, payload = conn.recv()
                except (EOFError, OSError):
                    raise self._dead(rank, doing) from None
                if tag not in (step, -1):
                    if tag in self._in_flight:  # an earlier stage's answer to a later step
                        self._early.setdefault(tag, {})[rank] = (kind, tag, payload)
                    continue  # else a reply to a step the engine gave up on
                replies[rank] = (kind, tag, payload)
                if startup and kind != "ready":  # the others may wait for it to join: stop here
                    raise _start_failure(rank, payload)
                if deadline is None and not startup:
                    deadline = self._answer_deadline(rank, kind, payload)
            for r, proc in enumerate(self._procs):
                if r not in replies and not proc.is_alive():
                    raise self._dead(r, doing)
            silent = [r for r in range(len(self._conns)) if r not in replies]
            stalled = stall is not None and stall.stalled(silent)
            if stalled:
                deadline = 0.0  # pipeline stages: the ranks still working have not used CPU for STEP_TIMEOUT_S
            if deadline is not None and time.monotonic() > deadline:
                # a stalled pipeline: a stage waits on its neighbour whichever of them hangs; a stopped process
                # is the one, else every silent rank is named
                stopped = [r for r in silent if proc_state(self._procs[r].pid) in ("T", "t")] if stalled else []
                rank = (stopped or silent)[0]
                others = "" if stopped or not stalled or len(silent) == 1 else \
                    f" (or one of workers {', '.join(map(str, silent[1:]))}, which wait on each other)"
                errors = [p for k, _, p in replies.values() if k != "ok"]
                raise WorkerDiedError(f"worker {rank} (pid {self._procs[rank].pid}) stopped answering (hung){others} "
                                      f"while {doing}" + (f"; the other ranks' collectives failed:\n{errors[0]}"
                                                          if errors else ""))
        return [replies[r] for r in range(len(self._conns))]

    def _answer_deadline(self, rank: int, kind: str, payload) -> float | None:
        """After rank `rank`'s answer to a step, until when the silent ranks may take (None: no bound from it;
        an earlier pipeline stage answers before the later ones compute): they finish the same step's work,
        or, when its collectives timed out, report theirs."""
        if len(self._conns) == 1 or (kind == "ok" and rank not in self._last_stage):
            return None
        timed_out = kind != "ok" and _collective_timeout(payload)
        return time.monotonic() + HANG_GRACE_S + (0 if timed_out else STEP_TIMEOUT_S)

    def _send_all(self, msg: tuple) -> None:
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(msg)
            except (OSError, ValueError) as e:
                raise self._dead(rank, f"sending a step ({e})") from None
            except Exception as e:  # noqa: BLE001 - e.g. a value that does not pickle
                raise ExecutorError(f"the step could not be sent to worker {rank}: {type(e).__name__}: {e}") from e

    def _fatal(self, e: WorkerDiedError) -> WorkerDiedError:
        """Several ranks that failed a step together are out of step for good: every later call says so."""
        if len(self._conns) > 1:
            self._broken = str(e)
        return e

    def _check_in_step(self) -> None:
        if self._broken is not None:
            raise WorkerDiedError(f"the parallel ranks are out of step since: {self._broken}")

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._check_in_step()
        if self._in_flight:
            raise ExecutorError("execute_model with steps in flight: collect them first")
        self.submit(sched)
        return self.collect()

    def submit(self, sched: SchedulerOutput) -> None:
        self._check_in_step()
        self._step += 1
        try:
            self._send_all(("execute", self._step, sched))
        except WorkerDiedError as e:
            raise self._fatal(e) from None
        self._in_flight.append(self._step)

    def collect(self) -> ModelRunnerOutput:
        self._check_in_step()
        step = self._in_flight[0]
        try:
            replies = self._gather("running a step", step)
        except WorkerDiedError as e:
            raise self._fatal(e) from None
        finally:
            self._in_flight.popleft()
        for rank, (kind, _, payload) in enumerate(replies):
            if kind != "ok":
                if len(self._conns) > 1:  # a rank that failed a step leaves the others' collectives behind
                    raise self._fatal(WorkerDiedError(f"worker {rank} failed a step (the ranks cannot go on "
                                                      f"together):\n{payload}"))
                raise ExecutorError(f"worker {rank} failed a step:\n{payload}")
        first = self._last_stage[0]
        out = replies[first][2]
        for rank in self._last_stage[1:]:
            if _tokens(replies[rank][2]) != _tokens(out):
                raise self._fatal(WorkerDiedError(f"tensor-parallel rank {rank} sampled other tokens than rank "
                                                  f"{first}: the ranks are out of step"))
        return out

    def comm_stats(self) -> list[dict] | None:
        return self.call("comm_stats") if len(self._conns) > 1 else None

    def call(self, method: str) -> list:
        """Worker method `method()` on every rank (no arguments; plain data back), in rank order; each rank
        answers after the steps sent before it."""
        self._check_in_step()
        self._step += 1  # (with steps in flight each rank answers once it has run them; their replies are kept)
        self._send_all(("call", self._step, method))
        replies = self._gather(f"answering {method}", self._step)
        for rank, (kind, _, payload) in enumerate(replies):
            if kind != "ok":
                raise ExecutorError(f"worker {rank} failed {method}:\n{payload}")
        return [payload for _, _, payload in replies]

    def shutdown(self) -> None:
        self._finalizer()


class _Stall:
    """Pipeline stages wait on each other for as long as the stage before computes, so an answer does not
    bound the others' time; instead, a step is stuck when the ranks that have not answered have together
    used less than `ACTIVE_CPU_S` of CPU time in `STEP_TIMEOUT_S` (a rank waiting for its input or for its
    send to be taken sleeps, its background threads waking now and then). Where /proc cannot be read it
    never says so (the last stage's answer still sets the others' deadline)."""

    def __init__(self, procs):
        self.procs, self.base, self.since = procs, {}, time.monotonic()

    def stalled(self, waiting: list[int]) -> bool:
        ticks = {r: cpu_ticks(self.procs[r].pid) for r in waiting}
        if None in ticks.values():
            return False
        used = sum(t - self.base.get(r, t) for r, t in ticks.items())
        if not self.base or used >= ACTIVE_CPU_S * CLOCK_TICKS:
            self.base, self.since = ticks, time.monotonic()
        return time.monotonic() - self.since > STEP_TIMEOUT_S



def _start_failure(rank: int, traceback_text) -> ExecutorError:
    return ExecutorError(f"worker {rank} failed to start:\n{traceback_text}")


def _collective_timeout(traceback_text) -> bool:
    """Whether a rank's failed step is its collectives timing out (a peer died or hangs)."""
    text = str(traceback_text)
    return "did not arrive within" in text or "Timed out" in text or "timed out" in text


def _tokens(out: ModelRunnerOutput) -> dict[int, list[int]]:
    return {sid: [t.token_id for t in tokens] for sid, tokens in out.sampled.items()}
