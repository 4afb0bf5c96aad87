"""The executor interface: the engine hands it a step as plain data and gets plain data back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from turbollm.engine_config import EngineConfig
from turbollm.handoff.kv_cache_spec import KVCacheConfig
from turbollm.handoff.runner_output import ModelRunnerOutput
from turbollm.handoff.scheduler_output import SchedulerOutput


class ExecutorError(RuntimeError):
    """A worker failed a step or died; the message names the worker and says why."""


class WorkerDiedError(ExecutorError):
    """A worker is gone (it exited, was killed, or its pipe is out of step): the engine cannot go on."""


class Executor(ABC):
    """Owns the workers: starts them (each loads the model and allocates its KV storage), runs every
    step on them, stops them. `loaded` is a model already loaded in this process, for executors
    whose worker runs here; `draft_kv_config`: a draft model's K/V (speculative decoding), for the worker
    that drafts."""

    def __init__(self, config: EngineConfig, kv_config: KVCacheConfig, loaded=None,
                 draft_kv_config: KVCacheConfig | None = None):
        self.config, self.kv_config, self.draft_kv_config = config, kv_config, draft_kv_config
        self.workers_config = config.for_workers()  # what the workers read (no scheduler limits)
        self.footprint = None  # the workers' ModelFootprint, set once they have loaded the model
        self._submitted: deque[SchedulerOutput] = deque()  # steps handed out, not yet collected

    def _set_footprints(self, footprints: list, tp: int) -> None:
        """Each rank's footprint, and the engine's: a tensor-parallel rank's share, or with pipeline
        stages the stages' together (one rank of each: what a step passes through)."""
        from turbollm.loader.footprint import ModelFootprint

        self.footprints = footprints
        self.footprint = footprints[0] if len(footprints) == tp else ModelFootprint.of_stages(footprints[::tp])

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; raises ExecutorError when a worker fails it."""

    # Steps in flight: the engine may hand out up to `max_steps_in_flight` steps (`submit`) before it takes
    # the oldest one's output (`collect`). An executor whose workers run a step at a time runs it in
    # `collect`; pipeline stages take the next step while the later stages finish the one before.
    max_steps_in_flight = 1

    def submit(self, sched: SchedulerOutput) -> None:
        self._submitted.append(sched)

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's output (raises as `execute_model` does)."""
        return self.execute_model(self._submitted.popleft())

    def comm_stats(self) -> list[dict] | None:
        """Each tensor-parallel rank's time, calls and bytes in collectives so far (None: one rank)."""
        return None

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
