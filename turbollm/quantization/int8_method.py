"""The "int8" linear method: weight-only int8, one symmetric scale per output channel.

Resident per layer: ``weight`` int8 ``[N, K]`` and ``weight_scale`` float32 ``[N]``
(8 bits per weight + 32 bits per row); ``W = weight * weight_scale[:, None]``. The product
goes through `kernels.quant.int8_linear`.

Two ways in:
- *quantized at load* (``quantization="int8"``): the layer is created with a dense float32
  weight that the loaders fill (a GGUF file is dequantized to float32 on the way); once the
  whole checkpoint is in, `process_model_after_loading` equalizes the decoder's input channels
  (`equalize.py`: no calibration text, the float function unchanged, so that a few large
  weights do not set the step of a whole row) and `process_weights_after_loading` rounds each
  layer to int8 and drops the float32 matrix. ``quantization="int8-rtn"`` skips the
  equalization (plain round-to-nearest). Peak memory while loading is therefore the float32 model.
- *from a checkpoint* (an 8-bit symmetric per-channel GPTQ folder, e.g. from
  ``turbollm quantize --method int8``): the layer is created in the int8 layout directly and
  the checkpoint converter (`gptq_method.py`) hands it int8 rows and scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from turbollm.kernels.quant import INT8_PER_CHANNEL, int8_kernel_path, int8_linear, int8_scale
from turbollm.log import init_logger
from turbollm.quantization.base import DecodeParts, LinearMethod, linear_layers, qmatmul_of, register_linear_method
from turbollm.quantization.group_quant import int8_per_channel


def set_int8_weight(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Replace the layer's weight by int8 codes ``[N, K]`` and float32 row scales ``[N]``."""
    layer.weight = nn.Parameter(q.to(torch.int8).contiguous(), requires_grad=False)
    layer.weight_scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)


@register_linear_method("int8")
class Int8LinearMethod(LinearMethod):
    """Per-output-channel symmetric int8 weights (quantized at load, or read from a checkpoint)."""

    vocab_table_type = int(GGMLQuantizationType.Q8_0)
    #: equalize input channels before rounding at load (see `equalize.py`)
    equalize = True

    def __init__(self, prequantized: bool = False):
        self.prequantized = prequantized

    def process_model_after_loading(self, model: nn.Module) -> None:
        if not self.equalize or self.prequantized or _has_int8_layers(model):
            return  # a checkpoint's codes, or rounded before: nothing to equalize
        from turbollm.errors import UnsupportedArchitectureError
        from turbollm.quantization.equalize import equalize_decoder

        try:
            report = equalize_decoder(model)
        except UnsupportedArchitectureError as e:
            init_logger().info("int8: no channel equalization (%s); plain round-to-nearest", e)
            return
        init_logger().info("int8: channel equalization before rounding: %s", report.summary())

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        if self.prequantized:
            layer.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.int8), requires_grad=False)
            layer.weight_scale = nn.Parameter(torch.zeros(out_features), requires_grad=False)
            layer.weight_scale.weight_loader = layer.weight_loader
        else:
            layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight.dtype == torch.int8:
            return  # already int8 (from a checkpoint, or processed before)
        q, scale = int8_per_channel(layer.weight.data)
        set_int8_weight(layer, q, scale)

    def format_bits(self, layer: nn.Module) -> float:
        """8-bit codes and a float16 scale per output row (we hold the scale as float32)."""
        return 8.0 + 16.0 / layer.in_features

    def decode_parts(self, layer: nn.Module) -> DecodeParts | None:
        w = layer.weight
        if w.dtype != torch.int8 or not int8_kernel_path(w):
            return None
        return DecodeParts(((INT8_PER_CHANNEL, w),), group_params=((int8_scale(layer.weight_scale), None, 0),))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.weight.dtype != torch.int8:  # loaded, not yet rounded (equalization's forward pass)
            return F.linear(x, layer.weight, bias)
        x2 = x.reshape(-1, layer.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        y = int8_linear(x2, layer.weight, layer.weight_scale, path=qmatmul_of(layer))
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], layer.out_features)


@register_linear_method("int8-rtn")
class Int8RTNLinearMethod(Int8LinearMethod):
    """``int8`` without the channel equalization: each row rounded to nearest as loaded."""

    equalize = False


def _has_int8_layers(model: nn.Module) -> bool:
    return any(m.weight.dtype == torch.int8 for m in linear_layers(model))
