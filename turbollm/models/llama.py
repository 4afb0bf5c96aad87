"""Llama-family decoder (SmolLM2, Llama) and Qwen2 (the same block with QKV bias).

Block: x += attn(norm(x)); x += mlp(norm(x)). The residual stream is carried beside the block
output and each norm adds the previous output into it (`RMSNorm(x, residual)`), so a block
costs no separate add. GQA through head grouping in the attention backend; tied embeddings
when the checkpoint has no separate output matrix.
"""

from __future__ import annotations

import torch
from torch import nn

from turbollm.config import ModelConfig
from turbollm.layers.norm import RMSNorm
from turbollm.models.common import CausalLM, GatedMLP, SelfAttention, make_embedding, make_final_norm, stage_layers
from turbollm.models.forward_batch import ForwardBatch
from turbollm.quantization import LinearMethod


class LlamaDecoderLayer(nn.Module):
    fused_decode_kind = "pre_norm"  # the runner's fused step (worker/fused_step.py) runs this block in C++

    def __init__(self, cfg: ModelConfig, idx: int, method: LinearMethod | None):
        super().__init__()
        self.self_attn = SelfAttention(cfg, idx, method)
        self.mlp = GatedMLP(cfg, method, idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(block output, residual stream); the stream excludes the output until the next norm adds it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, batch), residual)
        return self.mlp(h, batch), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, method: LinearMethod | None):
        super().__init__()
        self.embed_tokens = make_embedding(cfg)
        self.layers = stage_layers(cfg, lambda i: LlamaDecoderLayer(cfg, i, method))
        self.norm = make_final_norm(cfg, lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def embed(self, input_ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.embed_tokens(input_ids, reduce)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, method: LinearMethod | None = None):
        super().__init__(cfg)
        self.model = LlamaModel(cfg, method)
        self.tie_weights()


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama block with biases on Q, K and V (set by the config's attention_bias)."""
