"""RMSNorm in fp32: `x / sqrt(mean(x^2) + eps) * w`, optionally fused with the residual add.

`norm(x, residual)` first adds x into `residual` in place, then normalizes the sum: one pass
instead of an add, a copy and a norm, as the decoder blocks chain them. The C++ kernel
(`kernels/csrc/fused_ops.cpp`) runs it for float32; `rms_norm_reference` is the plain path.

Gemma stores its norm weight as an offset from one (it computes `x * (1 + w)`); the GGUF
converter has already added the one, so the loader adds it for Hugging Face weights and
the same layer serves both (see `offset` on the parameter's loader).
"""

from __future__ import annotations

import torch
from torch import nn

from turbollm.kernels import cpu_kernels
from turbollm.quantization.qtensor import copy_checked


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.weight_offset = weight_offset  # added to checkpoints stored as (w - offset)
        self.weight.hf_weight_loader = self._load_hf

    def _load_hf(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_checked(param, loaded.float() + self.weight_offset if self.weight_offset else loaded, "norm weight")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        kernels = cpu_kernels()
        if kernels is not None and x.dtype == torch.float32 and (residual is None or residual.dtype == torch.float32):
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_reference(x, self.weight, self.eps, residual)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    """The plain PyTorch RMSNorm (with `residual += x` first, in place, when given)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps) * weight).to(x.dtype)
