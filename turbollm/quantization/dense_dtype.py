"""The compute dtype of a model's dense weights: float32 (the exact reference) or bfloat16 (`dtype`, vLLM's
engine argument).

With "bfloat16" every dense weight — the linear layers of linear method "none" (an fp32/fp16/bf16
safetensors folder, a GGUF loaded with quantization "none") and a dense vocabulary table (the embedding and a dense LM
head) — is held in bfloat16: half the bytes of float32, so a decode step, which reads them all, reads half.
Their products go through `kernels.dense.dense_linear`: up to 16 rows our own pass over W (each bfloat16
weight widened to float32 in registers and multiplied by the float32 row: a row's result does not depend on
the rows beside it), beyond that oneDNN's bfloat16 matmul (AMX or AVX512_BF16 tiles where the CPU has them),
its input rounded to bfloat16 and its output widened back. Everything else — the residual stream, norms,
RoPE, attention, the logits — stays float32 (the K/V cache's "auto" becomes float16, `engine_args.kv_cache_torch_dtype`). Quantized weights (GGML blocks, int8/int4, GPTQ/AWQ)
are not touched: "bfloat16" concerns the dense ones only (the F32/F16 parts the "gguf" method keeps beside a
GGUF's block types stay float32 too: not converted yet).

"auto" picks bfloat16 where the CPU computes it in hardware (AVX512_BF16 or AMX-BF16 in its flags) and the
model has dense linear weights, float32 elsewhere (on an AVX2 machine bfloat16 products are emulated: slower
than float32). The default stays float32, the path the transformers oracle checks bit for bit.

Like the kernel form, the dtype is a property of the loaded weights: `set_dtype` converts a loaded model's
dense weights in place (after loading, as the kernel form repacks), and bumps its `weights_version`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from turbollm.errors import InvalidRequestError
from turbollm.kernels.dtypes import DENSE_DTYPES, check_dtype, cpu_has_bf16, dense_dtype_name

logger = logging.getLogger("turbollm")


def dense_linears(model: nn.Module) -> list[nn.Module]:
    """The linear layers of `model` whose weight is a dense float matrix (linear method "none")."""
    from turbollm.quantization.base import UnquantizedLinearMethod, linear_layers

    return [m for m in linear_layers(model) if isinstance(m.method, UnquantizedLinearMethod)]


def resolve_dtype(name: str, model: nn.Module, flags: str | None = None) -> torch.dtype:
    """The torch dtype `name` means for `model` on this CPU ("auto": bfloat16 for dense weights on a CPU with
    bfloat16 instructions, float32 otherwise: `kernels.dtypes.dense_dtype_name`)."""
    if DENSE_DTYPES[check_dtype(name)] == "bfloat16" and not cpu_has_bf16(flags):
        logger.warning("dtype bfloat16 on a CPU without AVX512_BF16 or AMX-BF16: its products are emulated "
                       "and likely slower than float32")
    return getattr(torch, dense_dtype_name(name, bool(dense_linears(model)), flags))


def _dense_tables(model: nn.Module) -> list[nn.Module]:
    """The vocabulary tables (embedding, LM head) of `model` held as dense float matrices."""
    return [m for m in model.modules() if getattr(m, "vocab_table", False) and getattr(m, "qtype", 1) is None]


def set_dtype(model: nn.Module, dtype: torch.dtype) -> bool:
    """Hold `model`'s dense weights (dense linear layers and vocabulary tables; a tied table once) in `dtype`
    (float32 or bfloat16); whether anything changed (then its `weights_version` is bumped: a fused step built
    before holds the old tensors)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise InvalidRequestError(f"dense weights in {dtype}: float32 or bfloat16 only")
    converted: dict[int, torch.Tensor] = {}  # by the old tensor's storage: a tied table converts once
    changed = False
    for m in [*dense_linears(model), *_dense_tables(model)]:
        w = m.weight
        if w.dtype == dtype:
            continue
        key = w.data_ptr()
        if key not in converted:
            converted[key] = w.data.to(dtype).contiguous()
        w.data = converted[key]
        changed = True
    if changed and hasattr(model, "weights_version"):
        model.weights_version += 1
    return changed
