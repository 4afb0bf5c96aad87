"""Gemma 3 text decoder.

Differences from Llama: embeddings scaled by sqrt(hidden); RMSNorm computes x·(1+w) (the
GGUF converter stores 1+w, HF checkpoints store w: the norm's loader adds the one); four
norms per block (pre/post around attention and around the MLP); per-head QK-norm;
attention scale query_pre_attn_scalar^-0.5; GELU(tanh) MLP; 5 of every 6 layers attend
within a sliding window with their own RoPE base; MQA on the small models.
"""

from __future__ import annotations

import torch
from torch import nn

from turbollm.config import ModelConfig
from turbollm.layers.norm import RMSNorm
from turbollm.models.common import CausalLM, GatedMLP, SelfAttention, make_embedding, make_final_norm, stage_layers
from turbollm.models.forward_batch import ForwardBatch
from turbollm.quantization import LinearMethod

GEMMA_NORM_OFFSET = 1.0


def _norm(cfg: ModelConfig) -> RMSNorm:
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, GEMMA_NORM_OFFSET)


class Gemma3DecoderLayer(nn.Module):
    fused_decode_kind = "sandwich"  # the runner's fused step (worker/fused_step.py) runs this block in C++

    def __init__(self, cfg: ModelConfig, idx: int, method: LinearMethod | None):
        super().__init__()
        self.self_attn = SelfAttention(cfg, idx, method, qk_norm_offset=GEMMA_NORM_OFFSET)
        self.mlp = GatedMLP(cfg, method, idx)
        self.input_layernorm = _norm(cfg)
        self.post_attention_layernorm = _norm(cfg)
        self.pre_feedforward_layernorm = _norm(cfg)
        self.post_feedforward_layernorm = _norm(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x += post_norm(attn(norm(x))); x += post_norm(mlp(norm(x))), with the residual stream
        carried beside the output: each pre-norm adds the previous output into it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.pre_feedforward_layernorm(self.post_attention_layernorm(self.self_attn(h, batch)), residual)
        return self.post_feedforward_layernorm(self.mlp(h, batch)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, method: LinearMethod | None):
        super().__init__()
        self.embed_scale = cfg.embedding_multiplier
        self.embed_tokens = make_embedding(cfg)
        self.layers = stage_layers(cfg, lambda i: Gemma3DecoderLayer(cfg, i, method))
        self.norm = make_final_norm(cfg, lambda: _norm(cfg))

    def embed(self, input_ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        x = self.embed_tokens(input_ids, reduce)  # (a share: scaled before the sum, exact: one share is non-zero)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, method: LinearMethod | None = None):
        super().__init__(cfg)
        self.model = Gemma3Model(cfg, method)
        self.tie_weights()
