"""Round-to-nearest offline quantization (``--method int4`` / ``int8``): no calibration data.

Every decoder linear is quantized on its own (`group_quant.rtn_quantize`); the quantized
model computes with the dequantized weights afterwards, like the calibrated methods leave it.
"""

from __future__ import annotations

import torch
from torch import nn

from turbollm.layers.linear import LinearBase
from turbollm.quantization.group_quant import QuantGrid, QuantizedWeight, rtn_quantize


@torch.no_grad()
def rtn_decoder(model: nn.Module, grid: QuantGrid, group_size: int) -> dict[str, QuantizedWeight]:
    """Quantize every decoder linear of `model` in place (fake quant); returns name → codes."""
    results = {}
    for name, layer in model.named_modules():
        if isinstance(layer, LinearBase):
            g = layer.in_features if group_size in (-1, 0) else group_size
            qw = rtn_quantize(layer.weight.data, grid, g)
            layer.weight.data.copy_(qw.dequantize())
            results[name] = qw
    return results
