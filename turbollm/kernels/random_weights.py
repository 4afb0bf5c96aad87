"""Random raw GGML weights for the quantized-matmul kernels' tests and benchmark.

gguf-py's quantizer where it implements the type; otherwise random bytes whose fp16 scale fields
are set to small finite values, so every block decodes to finite weights.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

# Byte offsets of the fp16 scale fields in a block of each type gguf-py cannot quantize.
F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_weight(qtype: T, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Raw blocks ``[n, row_bytes]`` of an ``n × k`` weight of type ``qtype``."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    if qtype in F16_FIELDS:
        raw = torch.randint(0, 256, (n * k // bs, ts), dtype=torch.uint8, generator=gen)
        for off in F16_FIELDS[qtype]:
            v = (torch.rand(raw.shape[0], generator=gen) * 0.01 + 0.001).half()
            raw[:, off : off + 2] = v.view(torch.uint8).view(-1, 2)
        return raw.view(n, -1)
    data = torch.randn(n, k, generator=gen).numpy()
    return torch.from_numpy(quants.quantize(data, qtype)).view(torch.uint8).view(n, -1)
