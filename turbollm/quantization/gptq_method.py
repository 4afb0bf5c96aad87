"""GPTQ checkpoints in the AutoGPTQ tensor layout, and the "gptq" method name.

Per linear (W is ``[N, K]``: N outputs, K inputs; G = K / group_size groups):
- ``qweight`` int32 ``[K * bits / 32, N]``: codes packed along K (little-endian bit stream, so
  3-bit codes straddle words as in AutoGPTQ);
- ``qzeros`` int32 ``[G, N * bits / 32]``: zero points packed along N, stored as ``zero - 1``
  (``checkpoint_format`` "gptq", AutoGPTQ's v1) or as is ("gptq_v2");
- ``scales`` float16 ``[G, N]``; ``g_idx`` int32 ``[K]``: the group of each input column.

``W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]``.

At load, codes go to our int4 layout (bits ≤ 4; 3-bit codes packed in 3 bits, `pack_3bit`)
or, for 8-bit symmetric per-channel files, to the int8 layout. Act-order (``desc_act``) files
have a ``g_idx`` that is not ``k // group_size``; we sort the columns by group (``perm =
argsort(g_idx)``, stable), store the codes in that order so each group is contiguous again,
and keep ``perm`` to permute the input before the kernel. Fused Q/K/V (and gate/up) need one
``perm``: their shards share an input, so a GPTQ run gives them the same Hessian and the same
order (checked at load).
"""

from __future__ import annotations

from typing import Any

import torch

from turbollm.errors import ModelFormatError
from turbollm.formats.packing import pack_int32, unpack_int32
from turbollm.quantization.base import register_linear_method
from turbollm.quantization.checkpoint_layouts import (CheckpointOnlyMethod, LayoutConfig, QuantLayout, check_choice,
                                                      config_int, register_layout)
from turbollm.quantization.group_quant import QuantizedWeight
from turbollm.quantization.int4_method import Int4LinearMethod, pack_codes
from turbollm.quantization.int8_method import Int8LinearMethod

GPTQ_BITS = (2, 3, 4, 8)


class GPTQLayout(QuantLayout):
    name = "gptq"
    tensor_suffixes = ("qweight", "qzeros", "scales", "g_idx")

    def parse_config(self, qcfg: dict[str, Any], where: str) -> LayoutConfig:
        bits = config_int(qcfg, ("bits", "w_bit"), where)
        check_choice(bits, GPTQ_BITS, "bits", where)
        group = config_int(qcfg, ("group_size", "q_group_size"), where, default=-1)
        if group != -1 and group <= 0:
            raise ModelFormatError(f"{where}: quantization_config.group_size must be positive or -1, got {group}")
        fmt = qcfg.get("checkpoint_format", "gptq")
        check_choice(fmt, ("gptq", "gptq_v2"), "checkpoint_format", where)
        sym = bool(qcfg.get("sym", True))
        if bits == 8 and not (sym and group == -1):
            raise ModelFormatError(f"{where}: 8-bit GPTQ is supported only symmetric and per channel "
                                   f"(sym=true, group_size=-1), got sym={sym}, group_size={group}")
        if qcfg.get("static_groups"):
            raise ModelFormatError(f"{where}: quantization_config.static_groups = true is not supported")
        return LayoutConfig("gptq", bits, group, act_order=bool(qcfg.get("desc_act", False)), symmetric=sym,
                            zero_offset=1 if fmt == "gptq" else 0)

    def linear_method(self, cfg: LayoutConfig):
        if cfg.bits == 8:
            return Int8LinearMethod(prequantized=True)
        return Int4LinearMethod(cfg.bits, cfg.group_size, prequantized=True, act_order=cfg.act_order)

    def to_internal(self, cfg: LayoutConfig, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        qweight, qzeros, scales, g_idx = (tensors[s] for s in self.tensor_suffixes)
        b = cfg.bits
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise ModelFormatError(f"{where}: qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
        k, n = qweight.shape[0] * 32 // b, qweight.shape[1]
        g = k if cfg.group_size == -1 else cfg.group_size
        if k % g or tuple(scales.shape) != (k // g, n) or tuple(qzeros.shape) != (k // g, n * b // 32) \
                or tuple(g_idx.shape) != (k,):
            raise ModelFormatError(f"{where}: inconsistent shapes qweight {list(qweight.shape)}, qzeros "
                                   f"{list(qzeros.shape)}, scales {list(scales.shape)}, g_idx {list(g_idx.shape)} "
                                   f"for {b}-bit, group size {g}")
        codes = unpack_int32(qweight, b, dim=0).t()  # [N, K]
        zeros = (unpack_int32(qzeros, b, dim=1) + cfg.zero_offset).t()  # [N, G]
        scales = scales.float().t().contiguous()
        perm = torch.argsort(g_idx.to(torch.int64), stable=True)
        if not torch.equal(g_idx.to(torch.int64)[perm], torch.arange(k) // g):
            raise ModelFormatError(f"{where}: g_idx does not put exactly {g} columns in each group")
        identity = torch.equal(perm, torch.arange(k))
        if not identity and not cfg.act_order:
            raise ModelFormatError(f"{where}: g_idx reorders columns but quantization_config.desc_act is false")
        if b == 8:
            if not bool((zeros == 128).all()):
                raise ModelFormatError(f"{where}: 8-bit GPTQ zero points must all be 128 (symmetric)")
            return {"weight": (codes - 128).to(torch.int8), "weight_scale": scales[:, 0].contiguous()}
        out = {"weight": pack_codes(codes[:, perm] if not identity else codes, b),
               "weight_scales": scales.to(torch.float16), "weight_zeros": zeros.to(torch.uint8).contiguous()}
        if cfg.act_order:
            out["weight_perm"] = perm
        return out

    def from_quantized(self, cfg: LayoutConfig, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        n, k = qw.shape
        b = qw.bits
        codes = qw.q.to(torch.int64)
        if qw.perm is not None:
            ordered = torch.empty_like(codes)
            ordered[:, qw.perm] = codes
            codes = ordered
        stored_zeros = qw.zeros.to(torch.int64) - cfg.zero_offset
        if bool((stored_zeros < 0).any()):
            raise ValueError("GPTQ v1 layout cannot store a zero point of 0 (quantize with zero_min=1)")
        return {
            "qweight": pack_int32(codes.t(), b, dim=0),
            "qzeros": pack_int32(stored_zeros.t(), b, dim=1),
            "scales": qw.scales.t().to(torch.float16).contiguous(),
            "g_idx": qw.group_index(),
        }

    def quantization_config(self, cfg: LayoutConfig, **extra: Any) -> dict[str, Any]:
        return {"quant_method": "gptq", "bits": cfg.bits, "group_size": cfg.group_size, "desc_act": cfg.act_order,
                "sym": cfg.symmetric, "static_groups": False, "true_sequential": True,
                "checkpoint_format": "gptq" if cfg.zero_offset == 1 else "gptq_v2",
                "model_file_base_name": "model", **extra}


register_layout(GPTQLayout())


@register_linear_method("gptq")
class GPTQLinearMethod(CheckpointOnlyMethod):
    """Name for GPTQ checkpoints; a GPTQ folder is detected from its config.json without it."""

    name = "gptq"
