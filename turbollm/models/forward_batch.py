"""The one object a model's forward pass receives: flat tokens, positions, and attention state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from turbollm.attention import AttentionBackend, AttentionMetadata
from turbollm.attention.kv_storage import LayerKVCache

#: hook(layer index, tensor): may change the tensor in place (a tensor-parallel all-reduce)
TensorHook = Callable[[int, torch.Tensor], None]


@dataclass
class LayerHooks:
    """Where a step lets other code in, at the same points in the module path and the fused C++ step:
    after each attention output projection and each MLP down projection (before any norm or
    residual add) — where a tensor-parallel all-reduce of the row-parallel partial sums goes. Layer
    ranges (`CausalLM.run_layers(start, end)`) are the points between layers: a pipeline stage's
    slice, a KV-connector send after a layer's K/V are stored."""

    attn_out: TensorHook | None = None
    mlp_out: TensorHook | None = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, the new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata  # the first KV-cache group's (every group shares query_start_loc and seq_lens)
    kv_caches: list[LayerKVCache]  # per layer: its paged storage
    backend: AttentionBackend
    max_position: int | None = None  # max(positions) when the caller knows it (saves a reduction per layer)
    # per layer, its KV-cache group's metadata (slot mapping and block tables differ by group); None: `attn`
    layer_attn: list[AttentionMetadata] | None = None
    hooks: LayerHooks | None = None

    def attn_for(self, layer_idx: int) -> AttentionMetadata:
        return self.attn if self.layer_attn is None else self.layer_attn[layer_idx]
