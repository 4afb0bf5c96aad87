"""The executor of ranks torchrun started (distributed/launch.py): this process is global rank 0, the
engine and rank 0's worker; the other ranks, on this host or others, run `run_worker` (below).

Each step is broadcast to every rank over the control group and rank 0's own worker runs it too; the
replies are gathered to rank 0 (the step's output is the first rank of the last pipeline stage's).
A rank that fails a step leaves the others' collectives behind: as in the multi-process executor,
that is fatal for the engine.
"""

from __future__ import annotations

import os
import random
import socket
import traceback

import torch.distributed as dist

from turbollm.distributed.launch import broadcast, gather, join_control_group
from turbollm.engine.executor.base import Executor, ExecutorError, WorkerDiedError
from turbollm.engine.runner_output import ModelRunnerOutput
from turbollm.engine.scheduler_output import SchedulerOutput
from turbollm.log import init_logger
from turbollm.procfs import pid_alive

logger = init_logger()


class TorchrunExecutor(Executor):
    def __init__(self, args, kv_config, loaded=None):
        from turbollm.engine.worker import Worker

        super().__init__(args, kv_config, loaded)
        self._group = join_control_group()
        world = dist.get_world_size()
        if world != args.world_size:
            broadcast((None, None, None), self._group)  # the workers stop (they cannot build a worker)
            dist.destroy_process_group()
            raise ExecutorError(f"torchrun started {world} processes, but tensor_parallel_size "
                                f"{args.tensor_parallel_size} x pipeline_parallel_size {args.pipeline_parallel_size} "
                                f"needs {args.world_size}")
        if (args.pp_steps_in_flight or 1) > 1:
            logger.warning("ranks torchrun started run a step at a time: pp_steps_in_flight %d is not used",
                           args.pp_steps_in_flight)
        seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(62)
        broadcast((args, kv_config, seed), self._group)
        self._out_rank = args.world_size - args.tensor_parallel_size
        self._broken: str | None = None
        self._closed = False
        failure = None
        try:
            self.worker = Worker(args, kv_config, rank=0, sampler_seed=seed)
            mine = ("ok", (self.worker.footprint(), _whereabouts()))
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
        self._set_footprints([p[0] for _, p in replies], args.tensor_parallel_size)
        self._where = [p[1] for _, p in replies]  # each rank's (host, pid): who to name when one is gone

    def _round(self, kind: str, payload, run) -> list:
        if self._broken is not None:
            raise WorkerDiedError(f"the torchrun ranks are out of step since: {self._broken}")
        try:
            broadcast((kind, payload), self._group)
        except Exception as e:  # noqa: BLE001 - a rank is gone (its connections closed)
            self._broken = f"{self._gone()}: the step could not be sent to every rank ({type(e).__name__}: {e})"
            raise WorkerDiedError(self._broken) from None
        try:
            mine = ("ok", run())
        except Exception as e:  # noqa: BLE001 - gathered with the others'
            mine = ("error", f"{type(e).__name__}: {e}")
        try:
            replies = gather(mine, self._group)
        except Exception as e:  # noqa: BLE001 - a rank died (its connections closed) or hangs (the gather timed out)
            self._broken = f"{self._gone()}: the ranks did not all answer {kind} ({type(e).__name__}: {e})" + (
                f"; rank 0: {mine[1]}" if mine[0] != "ok" else "")
            raise WorkerDiedError(self._broken) from None
        for rank, (k, p) in enumerate(replies):
            if k != "ok":
                self._broken = f"rank {rank} failed {kind}:\n{p}"
                raise WorkerDiedError(self._broken)
        return [p for _, p in replies]

    def _gone(self) -> str:
        """The ranks to blame when a collective with them failed: those on this host whose process is gone,
        else every other rank (gloo names only a peer's address)."""
        host = socket.gethostname()
        dead = [r for r, (h, pid) in enumerate(self._where) if r and h == host and not pid_alive(pid)]
        if dead:
            return ", ".join(f"rank {r} (pid {self._where[r][1]}) is gone" for r in dead)
        return "a rank is gone or hangs (" + ", ".join(f"rank {r}: pid {pid} on {h}" for r, (h, pid) in
                                                     enumerate(self._where) if r) + ")"

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
        if self._broken is not None:  # a rank that hangs would keep the broadcast waiting
            return
        try:
            broadcast(("shutdown", None), self._group)
        finally:
            dist.destroy_process_group()


def _whereabouts() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


def run_worker() -> bool:
    """A rank > 0: build the worker from what rank 0 sends, then run its messages until told to stop;
    False when it could not start (rank 0 says why)."""
    from turbollm.engine.worker import Worker

    group = join_control_group()
    rank = dist.get_rank()
    args, kv_config, seed = broadcast(None, group)
    if args is None:  # rank 0 refused the split (it says why)
        dist.destroy_process_group()
        return False
    try:
        worker = Worker(args, kv_config, rank=rank, sampler_seed=seed)
    except BaseException:  # noqa: BLE001 - reported to rank 0, which raises it; then its shutdown
        gather(("error", traceback.format_exc()), group)
        broadcast(None, group)
        dist.destroy_process_group()
        return False
    gather(("ok", (worker.footprint(), _whereabouts())), group)
    out_rank = args.world_size - args.tensor_parallel_size  # the first rank of the last stage
    try:
        while True:
            kind, payload = broadcast(None, group)
            if kind == "shutdown":
                return True
            try:
                if kind == "call":
                    reply = ("ok", getattr(worker, payload)())
                else:
                    out = worker.execute_model(payload)
                    reply = ("ok", out if rank == out_rank else None)
            except Exception:  # noqa: BLE001 - this step failed; rank 0 decides
                reply = ("error", traceback.format_exc())
            gather(reply, group)
    finally:
        dist.destroy_process_group()
