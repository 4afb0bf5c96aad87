"""Executors: how the engine reaches its workers. `distributed_executor_backend` names one
(vLLM's names): "uni", the worker in the engine's process; "mp", one worker process."""

from __future__ import annotations

from turbollm.engine.executor.base import Executor
from turbollm.engine.executor.multiproc import MultiprocExecutor
from turbollm.engine.executor.uniproc import UniProcExecutor
from turbollm.errors import InvalidRequestError

EXECUTORS: dict[str, type[Executor]] = {"uni": UniProcExecutor, "mp": MultiprocExecutor}


def get_executor_class(name: str) -> type[Executor]:
    try:
        return EXECUTORS[name]
    except KeyError:
        raise InvalidRequestError(f"distributed_executor_backend {name!r}: choose one of "
                                  f"{', '.join(EXECUTORS)}") from None


__all__ = ["EXECUTORS", "Executor", "MultiprocExecutor", "UniProcExecutor", "get_executor_class"]
