"""Executors: how the engine reaches its workers. `distributed_executor_backend` names one
(vLLM's names): "uni", the worker in the engine's process; "mp", worker processes the engine spawns
(one, or one per tensor-parallel rank and pipeline stage); "torchrun", ranks torchrun started on one
host or several (chosen by itself under torchrun)."""

from __future__ import annotations

from turbollm.errors import InvalidRequestError
from turbollm.executor.base import Executor
from turbollm.executor.multiproc import MultiprocExecutor
from turbollm.executor.torchrun import TorchrunExecutor
from turbollm.executor.uniproc import UniProcExecutor

EXECUTORS: dict[str, type[Executor]] = {"uni": UniProcExecutor, "mp": MultiprocExecutor,
                                        "torchrun": TorchrunExecutor}


def get_executor_class(name: str) -> type[Executor]:
    try:
        return EXECUTORS[name]
    except KeyError:
        raise InvalidRequestError(f"distributed_executor_backend {name!r}: choose one of "
                                  f"{', '.join(EXECUTORS)}") from None


__all__ = ["EXECUTORS", "Executor", "MultiprocExecutor", "TorchrunExecutor", "UniProcExecutor", "get_executor_class"]
