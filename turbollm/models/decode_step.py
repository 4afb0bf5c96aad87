"""The fused decode step: all decoder layers of a pure-decode batch in one C++ call.

A decode step of a small model is a few hundred short kernels, and the module path spends
~150 µs per layer between them (smollm2-135m: ~4.5 ms of a ~15 ms step) in module calls,
argument parsing and dispatch. `kernels/csrc/decode_step.cpp` holds each layer's tensors and
constants and runs the very same kernels on the same tensors in the same order, so its output,
and the K/V it stores, are bit-identical to the module path (tests/test_decode_step.py).

A model opts in per layer class (`fused_decode_kind`: "pre_norm" for the Llama block, "sandwich"
for Gemma 3's four norms; a subclass that changes `forward` must set it to None). A step takes
the fused path when the runner asks for it (`ForwardBatch.fused_decode`, off with
`EngineArgs.enforce_eager`) and: every sequence adds one token, the attention backend is the C++
one, the quantized matmuls take a q8 path at this batch size (`kernels.quant.q8_levels`), every
linear method describes its product (`LinearMethod.decode_parts`) with C++ kernels, and the
positions are inside the RoPE tables. Otherwise the module path runs, unchanged.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from turbollm.attention.backend import CPUKernelAttentionBackend
from turbollm.distributed import get_tp
from turbollm.kernels import cpu_kernels
from turbollm.kernels.quant import q8_levels
from turbollm.models.forward_batch import ForwardBatch
from turbollm.quantization.base import DENSE_PART, qmatmul_of

logger = logging.getLogger("turbollm")

KINDS = ("pre_norm", "sandwich")


class _State:
    """A decoder's built step: the C++ object, the K/V list it was given, its RoPE table length."""

    def __init__(self) -> None:
        self.step = None
        self.kv_ref: list | None = None
        self.rope_len = 0
        self.rope_tables: list = []  # each layer's cos table the step holds (RoPE growth replaces them)
        self.quantized = False
        self.steps = 0  # steps run fused
        self.unavailable: str | None = None  # why this decoder cannot take the step (logged once)


def run_layers(decoder: nn.Module, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """`decoder.layers` over x: (last block output, residual stream), fused when the step allows it."""
    out = _fused(decoder, x, batch) if batch.fused_decode else None
    if out is not None:
        return out[0], out[1]
    residual = None
    for layer in decoder.layers:
        x, residual = layer(x, residual, batch)
    return x, residual


def _fused(decoder: nn.Module, x: torch.Tensor, batch: ForwardBatch):
    meta = batch.attn
    if not meta.is_pure_decode or x.dtype != torch.float32 or x.dim() != 2 or not x.shape[0]:
        return None
    backend = batch.backend
    if not isinstance(backend, CPUKernelAttentionBackend) or backend.kernels is None:
        return None
    state = decoder.__dict__.get("_decode_step_state")
    if state is None:
        state = decoder._decode_step_state = _State()
    if state.unavailable is not None:
        return None
    if state.step is not None and any(layer.self_attn.rotary.cos is not cos
                                      for layer, cos in zip(decoder.layers, state.rope_tables)):
        state.step = None  # the module path grew the RoPE tables since the step was built
    if state.step is None:
        _build(decoder, state)
        if state.step is None:
            return None
    max_pos = batch.max_position if batch.max_position is not None else int(batch.positions.max())
    if max_pos >= state.rope_len:
        return None  # the module path grows the tables; the step is rebuilt on them next time
    levels = q8_levels(x.shape[0], qmatmul_of(decoder))
    if levels is None:
        if state.quantized:
            return None
        levels = 2  # dense layers only: the level count is never read
    if state.kv_ref is not batch.kv_caches:
        caches = batch.kv_caches
        if any(k.dtype not in (torch.float32, torch.float16) or k.dtype != v.dtype for k, v in caches):
            return None
        state.step.set_kv_caches([k for k, _ in caches], [v for _, v in caches])
        state.kv_ref = caches
    lens = meta.derived("decode_lens", lambda: torch.tensor(meta.seq_lens))
    state.steps += 1
    return state.step.forward(x, batch.positions, meta.block_tables, lens, meta.slot_mapping, levels)


def reset(decoder: nn.Module) -> None:
    """Forget a decoder's built step (its weights and K/V references): after new weights are
    loaded, or when another runner (with other K/V storage) takes the model."""
    decoder.__dict__.pop("_decode_step_state", None)


def _build(decoder: nn.Module, state: _State) -> None:
    kernels = cpu_kernels()
    reason = None
    if kernels is None or not hasattr(kernels, "DecodeStep"):
        reason = "C++ kernels unavailable"
    elif get_tp().tp_size != 1:
        reason = "tensor parallelism"
    specs = []
    for layer in ([] if reason else decoder.layers):
        spec, reason = _layer_spec(layer)
        if spec is None:
            break
        specs.append(spec)
    if reason is not None:
        state.unavailable = reason
        logger.info("turbollm: fused decode step not used for this model (%s); decoding through the modules", reason)
        return
    step = kernels.DecodeStep()
    try:
        for spec in specs:
            step.add_layer(spec)
    except RuntimeError as e:  # a layer the C++ side refuses: decode through the modules
        state.unavailable = f"the C++ step refused a layer: {str(e).splitlines()[0]}"
        logger.warning("turbollm: fused decode step not used for this model (%s)", state.unavailable)
        return
    state.step, state.kv_ref = step, None
    state.rope_len = min(layer.self_attn.rotary._cache_len for layer in decoder.layers)
    state.rope_tables = [layer.self_attn.rotary.cos for layer in decoder.layers]
    state.quantized = any(q != DENSE_PART for spec in specs for name in ("qkv", "o", "gate_up", "down")
                          for q in spec[name]["qtypes"])


def _linear_spec(layer: nn.Module) -> dict | None:
    parts = layer.method.decode_parts(layer)
    if parts is None:
        return None
    spec = {"qtypes": [q for q, _ in parts.parts], "weights": [w for _, w in parts.parts],
            "in_features": layer.in_features, "bias": layer.bias, "bias_in_linear": parts.bias_in_linear,
            "perm": parts.perm}
    if parts.group_params is not None:
        spec |= {"scales": [p[0] for p in parts.group_params], "zeros": [p[1] for p in parts.group_params],
                 "groups": [p[2] for p in parts.group_params]}
    return spec


def _layer_spec(layer: nn.Module) -> tuple[dict | None, str | None]:
    kind = getattr(type(layer), "fused_decode_kind", None)
    if kind not in KINDS:
        return None, f"{type(layer).__name__} has no fused decode kind"
    attn, mlp = layer.self_attn, layer.mlp
    if mlp.act.fused_code is None:
        return None, "activation without a fused kernel"
    norms = {"in_norm": layer.input_layernorm, "post_attn_norm": layer.post_attention_layernorm}
    if kind == "sandwich":
        norms |= {"pre_ff_norm": layer.pre_feedforward_layernorm, "post_ff_norm": layer.post_feedforward_layernorm}
    if attn.q_norm is not None:
        norms |= {"q_norm": attn.q_norm, "k_norm": attn.k_norm}
    eps = {n.eps for n in norms.values()}
    if len(eps) != 1:
        return None, "norms with different eps"
    spec = {name: n.weight for name, n in norms.items()}
    for name, lin in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                      ("down", mlp.down_proj)):
        spec[name] = _linear_spec(lin)
        if spec[name] is None:
            return None, f"{type(lin.method).__name__} has no fused decode product"
    spec |= {"cos": attn.rotary.cos, "sin": attn.rotary.sin, "num_heads": attn.num_heads,
             "num_kv_heads": attn.num_kv_heads, "head_dim": attn.head_dim, "window": attn.attn.window or -1,
             "act": mlp.act.fused_code, "eps": eps.pop(), "scale": attn.attn.scale,
             "softcap": attn.attn.softcap or 0.0}
    return spec, None
