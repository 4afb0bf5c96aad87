"""Gated activations over a merged gate/up projection: `act(gate) * up`.

SiLU and GELU (tanh) run in one C++ pass for float32 (`kernels/csrc/fused_ops.cpp`, its exp
is a polynomial accurate to ~2e-7 relative); the others, and the reference, in PyTorch.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from turbollm.kernels import cpu_kernels

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


# activations with a fused C++ kernel: name → the kernel's activation code
FUSED_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}


class GatedActivation(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        if name not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[name]
        self.fused_code = FUSED_CODES.get(name)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels()
        if kernels is not None and self.fused_code is not None and gate_up.dtype == torch.float32 \
                and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return kernels.gated_act(gate_up, self.fused_code)
        return gated_reference(self.act, gate_up)


def gated_reference(act: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
