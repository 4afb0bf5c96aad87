"""The executor of ranks torchrun started (distributed/launch.py): this process is global rank 0, the
engine and rank 0's worker; the other ranks, on this host or others, run `run_worker` (below).

Each step is broadcast to every rank over the control group and rank 0's own worker runs it too; the
replies are gathered to rank 0 (the step's output is the first rank of the last pipeline stage's).
Those collectives run in a thread of rank 0's own while the engine's thread reads the other ranks'
heartbeats (heartbeat.py): a rank that dies is found as its connections close (and named: on this host
by its pid, elsewhere by its heartbeats), one that hangs within 10 s, and either ends the engine
(`WorkerDiedError` naming the rank; every later step says the ranks are out of step). A rank that fails
a step leaves the others' collectives behind: as in the multi-process executor, that is fatal for the
engine too.
"""

from __future__ import annotations

import queue
import random
import threading
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from turbollm.distributed.launch import broadcast, gather, join_control_group
from turbollm.distributed.tensor_parallel import STEP_TIMEOUT_S
from turbollm.executor.base import Executor, ExecutorError, WorkerDiedError
from turbollm.executor.heartbeat import POLL_S, HangWatch, Heartbeat, whereabouts
from turbollm.gc_heap import freeze_startup_heap
from turbollm.handoff.runner_output import ModelRunnerOutput
from turbollm.handoff.scheduler_output import SchedulerOutput
from turbollm.log import init_logger
from turbollm.procfs import threads_cpu_s

logger = init_logger()


class TorchrunExecutor(Executor):
    def __init__(self, config, kv_config, loaded=None, draft_kv_config=None):
        from turbollm.worker.worker import Worker

        super().__init__(config, kv_config, loaded, draft_kv_config)
        par = config.parallel
        self._group = join_control_group()
        world = dist.get_world_size()
        if world != par.world_size:
            broadcast((None, None, None, None), self._group)  # the workers stop (they cannot build a worker)
            dist.destroy_process_group()
            raise ExecutorError(f"torchrun started {world} processes, but tensor_parallel_size "
                                f"{par.tensor_parallel_size} x pipeline_parallel_size {par.pipeline_parallel_size} "
                                f"needs {par.world_size}")
        if (par.pp_steps_in_flight or 1) > 1:
            logger.warning("ranks torchrun started run a step at a time: pp_steps_in_flight %d is not used",
                           par.pp_steps_in_flight)
        seed = config.model.seed if config.model.seed is not None else random.SystemRandom().getrandbits(62)
        broadcast((self.workers_config, kv_config, seed, draft_kv_config), self._group)
        self._out_rank = par.output_rank
        self._broken: str | None = None
        self._closed = False
        self._job: _Round | None = None  # the latest round given to the rounds' thread
        failure = None
        try:
            self.worker = Worker(self.workers_config, kv_config, rank=0, sampler_seed=seed,
                                 draft_kv_config=draft_kv_config)
            mine = ("ok", (self.worker.footprint(), whereabouts()))
        except BaseException as e:  # noqa: BLE001 - the others still answer the gather
            mine, failure = ("error", repr(e)), e
        try:
            replies = gather(mine, self._group)
        except Exception as e:  # noqa: BLE001 - a rank died while loading (its connections closed) or took too long
            self._broken = f"the ranks did not all start ({type(e).__name__}: {e})"
            raise WorkerDiedError(self._broken) from None
        failed = [(r, p) for r, (kind, p) in enumerate(replies) if kind != "ok"]
        if failed:
            try:
                self.shutdown()  # the ranks that failed wait for it too
            except Exception:  # noqa: BLE001 - the error to report is theirs
                pass
            rank, payload = failed[0]
            raise ExecutorError(f"rank {rank} failed to start:\n{payload}") from (failure if rank == 0 else None)
        self._set_footprints([p[0] for _, p in replies], par.tensor_parallel_size)
        self._where = [p[1] for _, p in replies]  # each rank's whereabouts: who to name when one is gone
        self._watch = HangWatch(self._where)
        self._sent = 0  # messages sent to the ranks since they started (the heartbeats count the same)
        self._jobs: queue.Queue[_Round] = queue.Queue()
        self._rounds: threading.Thread | None = None
        self._threads = torch.get_num_threads()  # set here by the worker; per thread under OpenMP

    def _round(self, kind: str, payload, run) -> list:
        """Message `kind` to every rank and their replies, in rank order. The collectives and rank 0's own part
        run in a thread of their own (`_rounds`): this one watches the other ranks' heartbeats meanwhile,
        so a rank that hangs ends the wait within 10 s (a gloo collective cannot be interrupted)."""
        if self._closed:
            raise ExecutorError("the torchrun executor is shut down")
        if self._broken is None and self._job is not None and not self._job.finished.is_set():
            self._broken = f"interrupted while the ranks ran {self._job.kind}"  # its wait ended early (Ctrl-C)
        if self._broken is not None:
            raise WorkerDiedError(f"the torchrun ranks are out of step since: {self._broken}")
        self._sent += 1
        job = self._submit(_Round(kind, payload, run))
        self._watch.begin(self._sent)
        try:
            while not job.finished.wait(POLL_S):
                why = self._watch.hung(None if job.ran.is_set() else self._own_cpu_s())
                if why is not None:
                    self._broken = f"{why} while {kind}" + (f"; rank 0: {job.own_error}" if job.own_error else "")
                    raise WorkerDiedError(self._broken)
        except BaseException:
            if self._broken is None:  # e.g. Ctrl-C: the step ends first, or the ranks are out of step
                self._broken = self._verdict(job) if job.finished.wait(STEP_TIMEOUT_S) else \
                    f"interrupted while the ranks ran {kind}"
            raise
        if self._broken is None:
            self._broken = self._verdict(job)
        if self._broken is not None:
            raise WorkerDiedError(self._broken)
        return job.replies

    def _submit(self, job: _Round) -> _Round:
        """Queue `job` for the rounds' thread: every collective of the control group is issued there, in order."""
        if self._rounds is None:
            self._rounds = threading.Thread(target=self._serve_rounds, name="turbollm-torchrun-rounds", daemon=True)
            self._rounds.start()
        self._job = job
        self._jobs.put(job)
        return job

    def _verdict(self, job: _Round) -> str | None:
        """Why the ranks are out of step after a finished round (None: they are not)."""
        if job.error is None:
            return None
        return f"{self._gone()}: {job.error}" if job.lost else job.error

    def _own_cpu_s(self) -> float:
        """CPU seconds of rank 0's own part: every thread of this process but its other Python threads (the
        rounds' thread, the OpenMP team it leads, gloo's; not the engine's or the server's)."""
        others = {t.native_id for t in threading.enumerate() if t is not self._rounds and t.native_id is not None}
        return threads_cpu_s(others)

    def _serve_rounds(self) -> None:
        """The rounds' thread: each message broadcast, rank 0's own part run, the replies gathered."""
        torch.set_num_threads(self._threads)
        while True:
            job = self._jobs.get()
            if job.kind == "shutdown":
                try:
                    broadcast(("shutdown", None), self._group)
                except BaseException as e:  # noqa: BLE001 - the ranks are gone already
                    job.error = f"{type(e).__name__}: {e}"
                job.finished.set()
                return
            try:
                job.replies = self._round_now(job)
            except _RoundFailed as e:
                job.error, job.lost = str(e), e.lost
            except BaseException as e:  # noqa: BLE001 - e.g. a step that does not pickle: the engine's to raise
                job.error = f"{type(e).__name__}: {e}"
            job.finished.set()
            if job.error is not None:
                return  # the ranks are out of step: no later round runs

    def _round_now(self, job: _Round) -> list:
        kind = job.kind
        try:
            broadcast((kind, job.payload), self._group)
        except Exception as e:  # noqa: BLE001 - a rank is gone (its connections closed)
            raise _RoundFailed(f"the step could not be sent to every rank ({type(e).__name__}: {e})", lost=True)
        try:
            mine = ("ok", job.run())
        except Exception as e:  # noqa: BLE001 - gathered with the others'
            mine = ("error", f"{type(e).__name__}: {e}")
            job.own_error = mine[1]
        job.ran.set()
        try:
            replies = gather(mine, self._group)
        except Exception as e:  # noqa: BLE001 - a rank died (its connections closed) or hangs (the gather timed out)
            raise _RoundFailed(f"the ranks did not all answer {kind} ({type(e).__name__}: {e})" + (
                f"; rank 0: {mine[1]}" if mine[0] != "ok" else ""), lost=True)
        for rank, (k, p) in enumerate(replies):
            if k != "ok":
                raise _RoundFailed(f"rank {rank} failed {kind}:\n{p}")
        return [p for _, p in replies]

    def _gone(self) -> str:
        """The ranks to blame when a collective with them failed (gloo names only a peer's address): those on this
        machine whose process has ended or is ending, else those whose heartbeats stopped without their seeing a
        failure, else every other rank."""
        dead = [r for r, w in enumerate(self._where) if r and w.ended()]
        if dead:
            return ", ".join(f"rank {r} (pid {self._where[r].pid}) is gone" for r in dead)
        quiet = self._watch.gone()
        if quiet:
            return ", ".join(f"{self._watch.name(r)} is gone (its heartbeats stopped)" for r in quiet)
        return "a rank is gone or hangs (" + ", ".join(f"rank {r}: {w}" for r, w in enumerate(self._where) if r) + ")"

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self._round("execute", sched, lambda: self.worker.execute_model(sched))[self._out_rank]

    def call(self, method: str) -> list:
        """Worker method `method()` on every rank, in rank order."""
        return self._round("call", method, lambda: getattr(self.worker, method)())

    def comm_stats(self) -> list[dict] | None:
        return self.call("comm_stats")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        job = self._job
        if self._broken is None and job is not None:  # a step left running (its wait interrupted)
            if not job.finished.wait(STEP_TIMEOUT_S):
                self._broken = f"shut down while the ranks ran {job.kind}"
            elif job.error is not None:
                self._broken = job.error
        if self._broken is not None:  # a rank that hangs would keep the broadcast waiting
            return
        if self._rounds is None:  # no step yet (or a failed start): this thread issues the broadcast
            try:
                broadcast(("shutdown", None), self._group)
            finally:
                dist.destroy_process_group()
            return
        job = self._submit(_Round("shutdown", None, None))
        if not job.finished.wait(STEP_TIMEOUT_S):
            logger.warning("the torchrun ranks were not told to stop: the broadcast did not end in %d s",
                           STEP_TIMEOUT_S)
            return
        if job.error is not None:
            logger.warning("the torchrun ranks were not all told to stop: %s", job.error)
        dist.destroy_process_group()


@dataclass(eq=False)
class _Round:
    """One message to every rank, between the engine's thread and the rounds' thread."""

    kind: str
    payload: object
    run: object  # rank 0's own part
    ran: threading.Event = field(default_factory=threading.Event)  # rank 0's own part is done
    finished: threading.Event = field(default_factory=threading.Event)
    replies: list | None = None
    error: str | None = None  # why the ranks are out of step now
    lost: bool = False  # a collective failed: a rank is gone or hangs (named by the engine's thread)
    own_error: str | None = None


class _RoundFailed(Exception):
    def __init__(self, message: str, lost: bool = False):
        super().__init__(message)
        self.lost = lost


def run_worker() -> bool:
    """A rank > 0: build the worker from what rank 0 sends, then run its messages until told to stop;
    False when it could not start (rank 0 says why)."""
    from turbollm.worker.worker import Worker

    group = join_control_group()
    rank = dist.get_rank()
    beat = Heartbeat(rank)
    config, kv_config, seed, draft_kv_config = broadcast(None, group)
    if config is None:  # rank 0 refused the split (it says why)
        dist.destroy_process_group()
        return False
    try:
        worker = Worker(config, kv_config, rank=rank, sampler_seed=seed, draft_kv_config=draft_kv_config)
    except BaseException:  # noqa: BLE001 - reported to rank 0, which raises it; then its shutdown
        gather(("error", traceback.format_exc()), group)
        broadcast(None, group)
        dist.destroy_process_group()
        return False
    freeze_startup_heap()  # this process is the worker's alone: full GC passes skip its start-up objects
    gather(("ok", (worker.footprint(), whereabouts())), group)
    out_rank = config.parallel.output_rank
    try:
        step = 0
        while True:
            try:
                kind, payload = broadcast(None, group)
            except Exception:
                beat.lost()  # rank 0 names the rank that is gone by the heartbeats that stopped without this
                raise
            if kind == "shutdown":
                return True
            step += 1
            try:
                if kind == "call":
                    reply = ("ok", getattr(worker, payload)())
                else:
                    out = worker.execute_model(payload)
                    reply = ("ok", out if rank == out_rank else None)
            except Exception:  # noqa: BLE001 - this step failed; rank 0 decides
                reply = ("error", traceback.format_exc())
            beat.done(step)
            try:
                gather(reply, group)
            except Exception:
                beat.lost()
                raise
    finally:
        dist.destroy_process_group()
