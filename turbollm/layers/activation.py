"""Gated activations over a merged gate/up projection: `act(gate) * up`."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class GatedActivation(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        if name not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[name]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up
