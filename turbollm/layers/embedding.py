"""Token embedding and LM head, vocabulary-parallel ready (tp size 1 today)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from turbollm.layers.linear import copy_checked


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.vocab_size, self.dim = vocab_size, dim
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)
        self.weight.weight_loader = lambda p, w, shard_id=None: copy_checked(p, w, "embedding")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(VocabEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)
