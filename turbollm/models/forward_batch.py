"""The one object a model's forward pass receives: flat tokens, positions, and attention state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turbollm.attention import AttentionBackend, AttentionMetadata


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, the new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K, V) paged storage
    backend: AttentionBackend
    max_position: int | None = None  # max(positions) when the caller knows it (saves a reduction per layer)
    fused_decode: bool = False  # a pure-decode step may run its layers in one C++ call (models/decode_step.py)
