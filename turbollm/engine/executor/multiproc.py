"""One worker in its own process (spawned, so it shares no threads or locks with the engine), reached
through a pipe: the step's `SchedulerOutput` goes over pickled, the `ModelRunnerOutput` comes back.

The engine's process never loads the weights: the worker does, and the engine keeps only the
model's config and tokenizer. A worker that raises during a step sends the traceback back (the
engine raises `ExecutorError` with it and the worker keeps serving); a worker that dies is noticed
within `POLL_S` seconds of the engine waiting on it, by its exit code.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import traceback
import weakref

from turbollm.engine.executor.base import Executor, ExecutorError
from turbollm.engine.runner_output import ModelRunnerOutput
from turbollm.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger("turbollm")
POLL_S = 1.0


def _worker_main(conn, args, kv_spec) -> None:
    """The worker process: build the worker, then run steps until told to stop or the pipe closes."""
    try:
        from turbollm.engine.worker import Worker

        worker = Worker(args, kv_spec)
    except BaseException:  # noqa: BLE001 - reported to the engine, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", worker.footprint()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "shutdown":
            return
        try:
            conn.send(("ok", worker.execute_model(msg[1])))
        except Exception:  # noqa: BLE001 - this step failed; the worker keeps serving
            conn.send(("error", traceback.format_exc()))


def _stop(proc, conn) -> None:
    try:
        conn.send(("shutdown",))
    except (OSError, ValueError):
        pass
    proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)
    conn.close()


class MultiprocExecutor(Executor):
    def __init__(self, args, kv_spec, loaded=None):
        super().__init__(args, kv_spec, loaded)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, args=(child, args, kv_spec), name="turbollm-worker-0",
                                 daemon=True)
        self._proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn)
        kind, payload = self._receive("starting")
        if kind != "ready":
            self.shutdown()
            raise ExecutorError(f"worker 0 failed to start:\n{payload}")
        self.footprint = payload

    def _receive(self, doing: str):
        while not self._conn.poll(POLL_S):
            if not self._proc.is_alive():
                raise ExecutorError(f"worker 0 (pid {self._proc.pid}) died while {doing} "
                                    f"(exit code {self._proc.exitcode})")
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            raise ExecutorError(f"worker 0 (pid {self._proc.pid}) closed its pipe while {doing} ({e or 'no reason'}); "
                                "a script that starts an engine with a worker process needs `if __name__ == "
                                "'__main__':` around its top level (multiprocessing's spawn re-imports it)") from None

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        try:
            self._conn.send(("execute", sched))
        except (OSError, ValueError) as e:
            raise ExecutorError(f"worker 0 (pid {self._proc.pid}) is gone: {e}") from None
        kind, payload = self._receive("running a step")
        if kind != "ok":
            raise ExecutorError(f"worker 0 failed a step:\n{payload}")
        return payload

    def shutdown(self) -> None:
        self._finalizer()
