"""GGUF tensors → (Hugging Face name, fp32 tensor) pairs, one tensor at a time.

GGUF uses llama.cpp's tensor names (`blk.3.attn_q.weight`); the models load by Hugging
Face names, so this table translates. Llama-architecture files store the rows of Q and K
permuted for llama.cpp's interleaved RoPE; `unpermute_rows` restores the HF order.
Tensors are dequantized lazily, so peak memory is the model plus one tensor.
"""

from __future__ import annotations

import re
import warnings
from typing import Iterator

import numpy as np
import torch

from turbollm.config import ModelConfig
from turbollm.errors import UnsupportedTensorTypeError, WeightLoadError
from turbollm.formats.gguf_file import GGUFFile, GGUFTensor

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture names a block tensor differently.
_ARCH_BLOCK_NAMES = {"gemma3": {"ffn_norm": "pre_feedforward_layernorm"}}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None if we do not know it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if not m:
        return None
    idx, part, kind = m.groups()
    part = _ARCH_BLOCK_NAMES.get(arch, {}).get(part) or _BLOCK_NAMES.get(part)
    return None if part is None else f"model.layers.{idx}.{part}.{kind}"


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: [h, D/2, 2, ...] → [h, 2, D/2, ...] per head."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def raw_tensor(t: GGUFTensor) -> torch.Tensor:
    """A zero-copy torch view of a GGUF tensor's bytes (the file is mapped read-only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # non-writable numpy array
        return torch.from_numpy(np.asarray(t.data))


def dequantize_tensor(t: GGUFTensor) -> torch.Tensor:
    from turbollm.formats.ggml_types import dequantize

    return dequantize(raw_tensor(t), t.qtype, t.shape, tensor_name=t.name)


def iter_gguf_weights(gguf: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) for every tensor of the file, in file order."""
    for name, t in gguf.tensors.items():
        target = hf_name(name, cfg.arch)
        if target is None:
            if name == "rope_freqs.weight":
                raise WeightLoadError(f"{gguf.path}: tensor {name!r} (RoPE frequency scaling) is not supported yet")
            raise WeightLoadError(f"{gguf.path}: unexpected tensor {name!r} for architecture {cfg.arch}")
        try:
            w = dequantize_tensor(t)
        except UnsupportedTensorTypeError as e:
            raise UnsupportedTensorTypeError(f"{gguf.path}: {e}") from None
        if cfg.arch == "llama" and target.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute_rows(w, cfg.num_heads if "q_proj" in target else cfg.num_kv_heads)
        yield target, w
