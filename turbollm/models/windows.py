"""Token windows through the model without an engine: batches of whole sequences on one scratch paged KV cache.

`WindowBatches` cuts token windows ``[S, L]`` into batches of whole sequences and builds, once, a `ForwardBatch` for
each (a scratch KV cache shared by every layer and batch: layers and batches run one at a time), so a model, a
layer or a residual branch can run on any batch; attention sees each window as one causal sequence. The int8
method's channel equalization runs calibration windows through it at load (`CausalLM.forward_windows`); the
offline quantizers' `quantize/calibration_runner.py` builds on it.
"""

from __future__ import annotations

import torch
from torch import nn

from turbollm.attention import AttentionMetadata, get_attention_backend
from turbollm.attention.kv_storage import LayerKVCache
from turbollm.models.forward_batch import ForwardBatch

TOKENS_PER_BATCH = 4096


class WindowBatches:
    """Token windows ``[S, L]`` cut into batches of whole sequences, each with its ForwardBatch."""

    def __init__(self, model: nn.Module, windows: torch.Tensor, tokens_per_batch: int = TOKENS_PER_BATCH,
                 block_size: int = 16):
        cfg = model.config
        self.model, self.windows = model, windows
        samples, seq_len = windows.shape
        self.seq_len = seq_len
        per = max(1, tokens_per_batch // seq_len)
        blocks_per_seq = -(-seq_len // block_size)
        shape = (per * blocks_per_seq, block_size, cfg.num_kv_heads, cfg.head_dim)
        cache = LayerKVCache.of(torch.zeros(shape), torch.zeros(shape))
        caches = [cache] * cfg.num_layers  # one scratch cache: layers and batches run one at a time
        backend = get_attention_backend()
        self.batches: list[tuple[slice, ForwardBatch]] = []
        for s0 in range(0, samples, per):
            s1 = min(samples, s0 + per)
            n = s1 - s0
            tables = torch.arange(n * blocks_per_seq, dtype=torch.int64).view(n, blocks_per_seq)
            pos = torch.arange(seq_len, dtype=torch.int64)
            slots = (tables[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
            meta = AttentionMetadata(slots, [i * seq_len for i in range(n + 1)], [seq_len] * n, tables, block_size)
            batch = ForwardBatch(windows[s0:s1].reshape(-1), pos.repeat(n), meta, caches, backend)
            self.batches.append((slice(s0 * seq_len, s1 * seq_len), batch))

    @property
    def num_tokens(self) -> int:
        return self.windows.numel()
