"""The fused step: the decoder layers of a decode batch, or of a few new tokens per sequence, in one
C++ call, owned by the model runner (as a GPU engine owns its captured graphs).

A decode step of a small model is a few hundred short kernels, and the module path spends
~150 µs per layer between them (smollm2-135m: ~4.5 ms of a ~15 ms step) in module calls,
argument parsing and dispatch. `kernels/csrc/decode_step.cpp` holds each layer's tensors and
constants and runs the very same kernels on the same tensors in the same order, so its output,
and the K/V it stores, are bit-identical to the module path (tests/test_fused_step.py).

The runner builds one `FusedDecodeStep` for its model and its KV storage: each layer's
`LayerKVCache` and KV-cache group (the block table and slot mapping it reads), and the step's
`LayerHooks` (called at the same points as the module path calls them: after each attention and
MLP output). Models know nothing of it: it reads their layers (`fused_decode_kind`: "pre_norm" for
the Llama block, "sandwich" for Gemma 3's four norms; a subclass that changes `forward` must set it
to None) and each linear method's description of its weight parts (`LinearMethod.decode_parts`).

A step runs fused when the attention backend is the C++ one, the quantized matmuls take a q8 path
at the step's token count (`kernels.quant.q8_levels`: up to 16 rows; a dense model at any count),
every linear method describes its product with C++ kernels, and the positions are inside the RoPE
tables. Decodes, and steps where no sequence brings more than 8 new tokens (a prompt's tail over its
cached prefix, speculative verification), attend with the decode kernel (one decode per new token:
row invariance); steps with longer runs of new tokens (short prompts, chunks) with the tiled one, as
the module path does.
Otherwise `forward` returns None and the runner takes the module path, unchanged. A pipeline stage's
step holds its layers only (`layers`) and runs them with the residual stream coming in from the stage
before.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from turbollm.attention.backend import CPUKernelAttentionBackend, recent_tensors
from turbollm.attention.kv_storage import LayerKVCache
from turbollm.kernels import cpu_kernels
from turbollm.kernels.quant import is_repacked, q8_levels
from turbollm.models.forward_batch import ForwardBatch, LayerHooks
from turbollm.quantization.base import DENSE_PART, qmatmul_of

logger = logging.getLogger("turbollm")

KINDS = ("pre_norm", "sandwich")


class FusedDecodeStep:
    def __init__(self, model: nn.Module, kv_caches: list[LayerKVCache], layer_groups: list[int],
                 hooks: LayerHooks | None = None, layers: range | None = None):
        self.model, self.hooks = model, hooks
        # the layers it runs: all, or a pipeline stage's range (its KV caches; the others' are None)
        self.layer_ids = layers if layers is not None else range(len(layer_groups))
        self.kv_caches = [kv_caches[i] for i in self.layer_ids]
        self.layer_groups = [layer_groups[i] for i in self.layer_ids]
        # per group, a layer of it (global index: where the batch keeps its metadata)
        self.group_first_layer = [layer_groups.index(g) for g in range(max(layer_groups) + 1)]
        self.step = None  # the C++ object, built on first use
        self.group_attention: list = []  # the (window, sinks) per group the C++ object was last given
        self._built_hooks: LayerHooks | None = None  # the hooks the C++ object calls
        self.built_version = -1  # the model's weights_version it was built from
        self.rope_len = 0
        self.rope_tables: list = []  # each layer's cos table the step holds (RoPE growth replaces them)
        self.rotaries: list = []  # each layer's rotary embedding, whose table a step compares with it
        self.quantized = False
        self.any_rows = False
        self.steps = 0  # steps run fused
        self.key_mass = False  # whether the built step has an eviction policy's key-mass output set
        self.unavailable: str | None = None  # why this model cannot take the step (logged once)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, start: int = 0, end: int | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Its layers start .. end - 1 (counted within `layer_ids`) of the batch, fused: (block output,
        residual stream), or None when this step cannot take the fused path."""
        meta = batch.attn
        if x.dtype != torch.float32 or x.dim() != 2 or not x.shape[0]:
            return None
        if not isinstance(batch.backend, CPUKernelAttentionBackend) or batch.backend.kernels is None:
            return None
        if self.unavailable is not None:
            return None
        if self.step is not None and (self.built_version != self.model.weights_version or any(
                rotary.cos is not cos for rotary, cos in zip(self.rotaries, self.rope_tables))):
            self.step = None  # new weights, or the module path grew the RoPE tables, since it was built
        if self.step is None:
            self._build()
            if self.step is None:
                return None
        if self.hooks is not self._built_hooks:  # the runner changed its hooks
            self._set_hooks()
        max_pos = batch.max_position if batch.max_position is not None else int(batch.positions.max())
        if max_pos >= self.rope_len:
            return None  # the module path grows the tables; the step is rebuilt on them next time
        levels = q8_levels(x.shape[0], qmatmul_of(self.model), self.any_rows)
        if levels is None:
            if self.quantized:
                return None
            levels = 2  # dense layers only: the level count is never read
        metas = [batch.attn_for(layer) for layer in self.group_first_layer]
        attention = [(m.window, m.sinks) for m in metas]
        if attention != self.group_attention:  # the KV policy's windows and sinks (streaming), per group
            self.step.set_group_attention([-1 if w is None else w for w, _ in attention], [s for _, s in attention])
            self.group_attention = attention
        lens = meta.derived("decode_lens", lambda: torch.tensor(meta.seq_lens))
        starts = None if meta.is_pure_decode else meta.derived("query_start_loc",
                                                               lambda: torch.tensor(meta.query_start_loc))
        km = meta.key_mass  # an eviction policy's scores: each layer adds its attention mass per table entry
        if km is not None or self.key_mass:
            self.step.set_key_mass(None if km is None else meta.derived("key_mass_first",
                                                                        lambda: torch.tensor(km.first_rows)),
                                   None if km is None else km.out)
            self.key_mass = km is not None
        self.steps += 1
        end = len(self.rotaries) if end is None else end
        recent = []
        if metas[0].recent is not None:  # a quantized format: per group its step's ring slots and bounds
            for m in metas:
                t = m.derived("recent_tensors", lambda m=m: recent_tensors(m))
                recent += [t["slots"], t["first"], t["old"], t["new"], t["read"]]
        return self.step.forward(x, residual, batch.positions, [m.block_tables for m in metas], lens,
                                 [m.slot_mapping for m in metas], starts, levels, start, end, recent)

    def _layers(self) -> list[nn.Module]:
        return [self.model.model.layers[i] for i in self.layer_ids]

    def _set_hooks(self) -> None:
        hooks = self.hooks or LayerHooks()
        self.step.set_hooks(hooks.attn_out, hooks.mlp_out)
        self._built_hooks = self.hooks

    def _build(self) -> None:
        kernels = cpu_kernels()
        reason = None
        if kernels is None or not hasattr(kernels, "DecodeStep"):
            reason = "C++ kernels unavailable"
        elif len({c.layout.quant for c in self.kv_caches}) > 1 or any(
                c.layout.quant is None and (c.k.dtype not in (torch.float32, torch.float16) or c.k.dtype != c.v.dtype)
                for c in self.kv_caches):
            reason = "a KV-cache format without fused kernels"
        layers = self._layers()
        specs = []
        for layer in ([] if reason else layers):
            spec, reason = _layer_spec(layer)
            if spec is None:
                break
            specs.append(spec)
        if reason is not None:
            self.unavailable = reason
            logger.info("turbollm: fused decode step not used for this model (%s); decoding through the modules", reason)
            return
        step = kernels.DecodeStep()
        self.key_mass = False
        try:
            for spec in specs:
                step.add_layer(spec)
        except RuntimeError as e:  # a layer the C++ side refuses: decode through the modules
            self.unavailable = f"the C++ step refused a layer: {str(e).splitlines()[0]}"
            logger.warning("turbollm: fused decode step not used for this model (%s)", self.unavailable)
            return
        step.set_kv_caches([c.k for c in self.kv_caches], [c.v for c in self.kv_caches], list(self.layer_groups))
        lay = self.kv_caches[0].layout
        if lay.quant is not None:  # int8 / int4 blocks with float16 scales and each sequence's ring of recent tokens
            step.set_quant_kv([[c.k, c.v, c.k_scale, c.v_scale, c.k_recent, c.v_recent] for c in self.kv_caches],
                              lay.ring_blocks, lay.quant_bits)
        self.group_attention = []
        self.step, self.built_version = step, self.model.weights_version
        self._set_hooks()
        self.rope_len = min(layer.self_attn.rotary._cache_len for layer in layers)
        self.rotaries = [layer.self_attn.rotary for layer in layers]  # (looked up once: each step checks them)
        self.rope_tables = [rotary.cos for rotary in self.rotaries]
        qtypes = [q for spec in specs for name in ("qkv", "o", "gate_up", "down") for q in spec[name]["qtypes"]]
        self.quantized = any(q != DENSE_PART for q in qtypes)
        # every quantized weight repacked (a repacking form: avx512_vnni, avx2_tiles, amx): one numerics, and the fused step, for any rows
        self.any_rows = all(q == DENSE_PART or is_repacked(q) for q in qtypes)


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
