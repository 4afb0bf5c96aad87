"""GGUF tensors → (Hugging Face name, tensor) pairs, one tensor at a time.

GGUF uses llama.cpp's tensor names (`blk.3.attn_q.weight`); the models load by Hugging
Face names, so this table translates. Llama-architecture files store the rows of Q and K
permuted for llama.cpp's interleaved RoPE; `unpermute_rows` restores the HF order (on float
rows or on whole rows of GGML blocks alike).

Two modes, chosen by the linear method (`LinearMethod.accepts_ggml_blocks`):
- float32 (`keep_quantized=False`): every tensor is dequantized lazily, so peak memory is the
  model plus one tensor;
- native (`keep_quantized=True`): a block-quantized 2-D tensor is yielded as a
  `QuantizedTensor` whose bytes are a zero-copy view of the mapped file (the layer that keeps
  it makes its own copy); float tensors (F32/F16/BF16) and 1-D tensors still come as float32.
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
from turbollm.quantization.qtensor import QuantizedTensor, ggml_type_name

#: GGUF float types: always handed over as float32, never as raw blocks.
_FLOAT_TYPES = frozenset({0, 1, 28, 30})  # F32, F16, F64, BF16

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
#: Tensors the config reads (`config_from_gguf`), not weights: Llama 3's RoPE frequency factors.
CONFIG_TENSORS = frozenset({"rope_freqs.weight"})


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


def quantized_tensor(t: GGUFTensor) -> QuantizedTensor:
    """The raw blocks of a block-quantized 2-D tensor (a view of the file), if we can decode its type."""
    from turbollm.formats.ggml_types import is_supported

    if not is_supported(t.qtype):
        raise UnsupportedTensorTypeError(f"unsupported GGUF type {ggml_type_name(t.qtype)} in tensor {t.name}")
    return QuantizedTensor(raw_tensor(t).reshape(t.shape[0], -1), t.qtype, tuple(t.shape), t.name)


def _keeps_blocks(t: GGUFTensor) -> bool:
    return len(t.shape) == 2 and t.qtype not in _FLOAT_TYPES


def iter_gguf_weights(gguf: GGUFFile, cfg: ModelConfig, *,
                      keep_quantized: bool = False, keep=None) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (HF name, tensor) for every tensor of the file, in file order (with `keep`, a predicate on
    the HF name, only the tensors it keeps are decoded).

    The tensor is float32, or with `keep_quantized` a `QuantizedTensor` for block-quantized
    matrices. An undecodable type raises UnsupportedTensorTypeError naming file and tensor.
    """
    for name, t in gguf.tensors.items():
        if name in CONFIG_TENSORS:
            continue
        target = hf_name(name, cfg.arch)
        if target is None:
            raise WeightLoadError(f"{gguf.path}: unexpected tensor {name!r} for architecture {cfg.arch}")
        if keep is not None and not keep(target):
            continue
        try:
            w = quantized_tensor(t) if keep_quantized and _keeps_blocks(t) else dequantize_tensor(t)
        except UnsupportedTensorTypeError as e:
            raise UnsupportedTensorTypeError(f"{gguf.path}: {e}") from None
        if cfg.arch == "llama" and target.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in target else cfg.num_kv_heads
            w = w.map_rows(lambda rows: unpermute_rows(rows, heads)) if isinstance(w, QuantizedTensor) \
                else unpermute_rows(w, heads)
        yield target, w
