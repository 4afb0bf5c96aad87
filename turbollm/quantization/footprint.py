"""What a model's weights should occupy by the definition of their formats (to set beside what they do).

`format_bytes(model)` adds, per linear layer, parameters × the format's bits per weight as its
checkpoint layout defines them (`LinearMethod.format_bits`: AutoGPTQ/AutoAWQ's int4 is b-bit
codes plus a float16 scale and a b-bit zero point per group), and every other tensor at its
resident size: norms, biases, buffers and the vocabulary tables, whose storage (float32 or GGML
blocks) is their format. `resident_bytes(model) / format_bytes(model)` then says how much the
in-memory layout adds to the format: 1.00 for GGUF blocks kept as they are, ~1.01-1.04 for
int4 and int3 (a uint8 zero point instead of a packed one), more where a format is held in a
wider container (2-bit codes in 4-bit nibbles).
"""

from __future__ import annotations

import torch

from turbollm.quantization.base import linear_layers


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def format_bytes(model: torch.nn.Module) -> float:
    """Bytes of `model`'s weights by their formats' definitions (each storage counted once)."""
    covered: set[int] = set()
    total = 0.0
    for module in linear_layers(model):
        total += module.method.format_bits(module) * module.in_features * module.out_features / 8
        if module.bias is not None:
            total += module.bias.numel() * module.bias.element_size()
        covered.update(_ptr(p) for p in module.parameters())  # weight_parts too
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and _ptr(t) not in covered:
            total += t.untyped_storage().nbytes()
            covered.add(_ptr(t))
    return total
