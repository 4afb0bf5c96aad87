"""Calibration tokens through the decoder, one layer and one residual branch at a time (offline quantizers).

GPTQ and AWQ work layer by layer: the calibration tokens' hidden states enter layer i, each of its residual
branches (`models/branches.py`) is quantized with inputs computed by the already-quantized parts before it, and the
branch's output is added for what follows. `CalibrationRunner` is the windows' batches (`models/windows.py`) plus
the layer-0 input and an even spread of batches; `capture_input` / `run_until_captured` record a module's input
and stop the forward pass there.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from turbollm.models.branches import ArchAdapter
from turbollm.models.windows import WindowBatches


class _Stop(Exception):
    """Raised by a capture hook to end a forward pass early."""


@contextmanager
def capture_input(module: nn.Module, stop: bool = True) -> Iterator[dict]:
    """Record the first positional input of `module` in ``box["x"]``; with `stop`, skip the module
    (and the rest of the forward pass: call through `run_until_captured`)."""
    box: dict = {}

    def hook(mod, args):
        box["x"] = args[0]
        if stop:
            raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        yield box
    finally:
        handle.remove()


def run_until_captured(fn: Callable[[], object], box: dict) -> torch.Tensor:
    box.pop("x", None)
    try:
        fn()
    except _Stop:
        pass
    if "x" not in box:
        raise RuntimeError("the capture hook did not fire: the module is not on this forward path")
    return box.pop("x")


def spread_indices(n: int, count: int) -> list[int]:
    """`count` indices of ``range(n)`` spread evenly from the first to the last (all when count ≥ n)."""
    if count >= n:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(1, count - 1)) for i in range(count)})


class CalibrationRunner(WindowBatches):
    """Token windows ``[S, L]`` cut into batches of whole sequences, each with its ForwardBatch; the layer-0
    input of every token and an even spread of batches for the quantizers."""

    def embed(self, adapter: ArchAdapter) -> torch.Tensor:
        """Layer-0 input of every calibration token, float32 ``[tokens, hidden]``."""
        with torch.no_grad():
            return torch.cat([adapter.embed(self.model, b.input_ids) for _, b in self.batches])

    def spread(self, count: int) -> list[int]:
        """Indices of `count` batches spread evenly over all of them (all when count ≥ len)."""
        return spread_indices(len(self.batches), count)
