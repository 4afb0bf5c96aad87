"""One worker in its own process (spawned, so it shares no threads or locks with the engine), reached
through a pipe: the step's `SchedulerOutput` goes over pickled, the `ModelRunnerOutput` comes back,
both tagged with the step's number.

The engine's process never loads the weights: the worker does, and the engine keeps only the
model's config and tokenizer. A worker that raises during a step sends the traceback back (the
engine raises `ExecutorError` with it and the worker keeps serving); a worker that dies is noticed
within `POLL_S` seconds of the engine waiting on it and reported with its exit code
(`WorkerDiedError`: the engine cannot go on). A reply the engine stopped waiting for (Ctrl-C while
a step ran) is recognised by its number and dropped. The worker ignores SIGINT: Ctrl-C in a
terminal reaches the whole process group, and it is the engine's to handle.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import traceback
import weakref

from turbollm.engine.executor.base import Executor, ExecutorError, WorkerDiedError
from turbollm.engine.runner_output import ModelRunnerOutput
from turbollm.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger("turbollm")
POLL_S = 1.0


def _worker_main(conn, args, kv_config) -> None:
    """The worker process: build the worker, then run steps until told to stop or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from turbollm.engine.worker import Worker

        worker = Worker(args, kv_config)
    except BaseException:  # noqa: BLE001 - reported to the engine, which raises it
        conn.send(("error", 0, traceback.format_exc()))
        return
    conn.send(("ready", 0, worker.footprint()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        except BaseException:  # noqa: BLE001 - a message that does not unpickle: say so, keep serving
            conn.send(("error", -1, traceback.format_exc()))
            continue
        if msg[0] == "shutdown":
            return
        try:
            conn.send(("ok", msg[1], worker.execute_model(msg[2])))
        except Exception:  # noqa: BLE001 - this step failed; the worker keeps serving
            conn.send(("error", msg[1], traceback.format_exc()))


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
    def __init__(self, args, kv_config, loaded=None):
        super().__init__(args, kv_config, loaded)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, args=(child, args, kv_config), name="turbollm-worker-0",
                                 daemon=True)
        self._proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn)
        self._step = 0
        try:
            kind, _, payload = self._receive("starting", 0)
        except WorkerDiedError as e:
            self.shutdown()
            raise WorkerDiedError(f"{e}; a script that starts an engine with a worker process needs "
                                  "`if __name__ == '__main__':` around its top level (multiprocessing's "
                                  "spawn re-imports it)") from None
        if kind != "ready":
            self.shutdown()
            raise ExecutorError(f"worker 0 failed to start:\n{payload}")
        self.footprint = payload

    def _dead(self, doing: str) -> WorkerDiedError:
        self._proc.join(timeout=1)
        code = self._proc.exitcode
        how = ("is still running" if code is None else
               f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
        return WorkerDiedError(f"worker 0 (pid {self._proc.pid}) {how} while {doing}")

    def _receive(self, doing: str, step: int):
        """The worker's reply to step `step` (replies to steps the engine gave up on are dropped)."""
        while True:
            while not self._conn.poll(POLL_S):
                if not self._proc.is_alive():
                    raise self._dead(doing)
            try:
                kind, tag, payload = self._conn.recv()
            except (EOFError, OSError):
                raise self._dead(doing) from None
            if tag in (step, -1):
                return kind, tag, payload

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._step += 1
        try:
            self._conn.send(("execute", self._step, sched))
        except (OSError, ValueError) as e:
            raise self._dead(f"sending a step ({e})") from None
        except Exception as e:  # noqa: BLE001 - e.g. a value that does not pickle
            raise ExecutorError(f"the step could not be sent to worker 0: {type(e).__name__}: {e}") from e
        kind, _, payload = self._receive("running a step", self._step)
        if kind != "ok":
            raise ExecutorError(f"worker 0 failed a step:\n{payload}")
        return payload

    def shutdown(self) -> None:
        self._finalizer()
