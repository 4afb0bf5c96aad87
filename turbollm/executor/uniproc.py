"""The worker in the engine's own process (today's behaviour, and the default)."""

from __future__ import annotations

from turbollm.executor.base import Executor
from turbollm.handoff.runner_output import ModelRunnerOutput
from turbollm.handoff.scheduler_output import SchedulerOutput
from turbollm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config, kv_config, loaded=None, draft_kv_config=None):
        super().__init__(config, kv_config, loaded, draft_kv_config)
        self.worker = Worker(self.workers_config, kv_config, loaded, draft_kv_config=draft_kv_config)
        self.footprint = self.worker.footprint()

    @property
    def loaded(self):
        """The model the worker holds (benchmarks read its weights' footprint)."""
        return self.worker.loaded

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def shutdown(self) -> None:
        self.worker.close()
