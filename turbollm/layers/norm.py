"""RMSNorm in fp32: `x / sqrt(mean(x^2) + eps) * w`.

Gemma stores its norm weight as an offset from one (it computes `x * (1 + w)`); the GGUF
converter has already added the one, so the loader adds it for Hugging Face weights and
the same layer serves both (see `offset` on the parameter's loader).
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.weight_offset = weight_offset  # added to checkpoints stored as (w - offset)
        self.weight.hf_weight_loader = self._load_hf

    def _load_hf(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        from turbollm.layers.linear import copy_checked

        copy_checked(param, loaded.float() + self.weight_offset if self.weight_offset else loaded, "norm weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return (xf * torch.rsqrt(var + self.eps) * self.weight).to(x.dtype)
