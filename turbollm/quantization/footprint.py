"""What a model's weights should occupy by the definition of their formats (to set beside what they do).

`format_bytes(model)` adds, per weight matrix, parameters × the format's bits per weight as its
checkpoint layout defines them (`LinearMethod.format_bits`: AutoGPTQ/AutoAWQ's int4 is b-bit
codes plus a float16 scale and a b-bit zero point per group; a GGML type is its block size), and
every other tensor (norms, biases, buffers) at its resident size. `resident_bytes(model) /
format_bytes(model)` then says how much the in-memory layout adds to the format: 1.00 for GGUF
blocks kept as they are, ~1.01 for int4 (a uint8 zero point instead of a packed one), more where
a format is held in a wider container (3-bit codes in 4-bit nibbles).
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def ggml_bits(qtype: int) -> float:
    """Bits per weight of a GGML block type (Q4_0: 4.5, Q8_0: 8.5, Q4_K: 4.5, ...)."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    return 8.0 * nbytes / block


def format_bytes(model: torch.nn.Module) -> float:
    """Bytes of `model`'s weights by their formats' definitions (each storage counted once)."""
    from turbollm.layers.embedding import VocabEmbedding
    from turbollm.layers.linear import LinearBase

    covered: set[int] = set()
    total = 0.0
    for module in model.modules():
        if isinstance(module, LinearBase):
            total += module.method.format_bits(module) * module.in_features * module.out_features / 8
            if module.bias is not None:
                total += module.bias.numel() * module.bias.element_size()
            covered.update(_ptr(p) for p in module.parameters())  # weight_parts too
        elif isinstance(module, VocabEmbedding) and _ptr(module.weight) not in covered:
            qtype = module.qtype
            bits = ggml_bits(qtype) if qtype is not None else 8 * module.weight.element_size()
            total += bits * module.vocab_size * module.dim / 8
            covered.add(_ptr(module.weight))
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and _ptr(t) not in covered:
            total += t.untyped_storage().nbytes()
            covered.add(_ptr(t))
    return total
