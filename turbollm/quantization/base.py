"""The linear-layer strategy interface and the unquantized (fp32) strategy."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

LINEAR_METHODS: dict[str, type["LinearMethod"]] = {}


def register_linear_method(name: str) -> Callable[[type["LinearMethod"]], type["LinearMethod"]]:
    def deco(cls: type[LinearMethod]) -> type[LinearMethod]:
        LINEAR_METHODS[name] = cls
        return cls

    return deco


class LinearMethod:
    """How one linear layer stores its weights and multiplies by them."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def weight_bytes(self, layer: nn.Module) -> int:
        """Resident bytes of this layer's weight storage."""
        return sum(p.numel() * p.element_size() for n, p in layer.named_parameters(recurse=False) if n != "bias")


@register_linear_method("none")
class UnquantizedLinearMethod(LinearMethod):
    """A dense weight `[out, in]` in the working dtype (fp32 on CPU)."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


def get_linear_method(name: str | None) -> LinearMethod:
    key = name or "none"
    if key not in LINEAR_METHODS:
        raise ValueError(f"unknown quantization {name!r}; available: {', '.join(sorted(LINEAR_METHODS))}")
    return LINEAR_METHODS[key]()
